"""Gateway: the engine's front door.

Validates requests, applies backpressure (a bounded number of requests in
flight; over it a clear ``EngineOverloaded``, never an unbounded queue),
streams each request's deltas back on that request's own stream, turns a
caller that goes away into an ``Abort``, and reports a request's failure on
its stream only. While draining it admits nothing new.
"""

from __future__ import annotations

import logging
import math
from typing import Any, assert_never

import anyio
import msgspec

from actors.channel import ChannelReceiver, ChannelSender, channel
from actors.messages import Handoff, Wire
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure
from actors.scheduler import Abort, Admit
from actors.scheduler_core import RowDelta
from engine.errors import EngineDead, EngineDraining, EngineOverloaded, InvalidRequest, RequestFailed
from engine.ports import ModelInfo
from engine.request_check import check_limits
from engine.types import Delta, SamplingParams

log = logging.getLogger("ember.gateway")


# ---------------------------------------------------------------------------
# Messages the Gateway accepts.


class Submit(Handoff, frozen=True):
    """Caller → Gateway (ask): admit a request; the reply is ``(rid, stream)``
    or an error (``InvalidRequest``, ``EngineOverloaded``, ``EngineDraining``).
    A hand-off: its answer is a live stream."""

    tokens: list[int]
    params: SamplingParams
    ns: str = ""


class Cancel(Wire, frozen=True):
    """Caller → Gateway: the caller stopped reading ``rid``'s stream."""

    rid: int


class StepOutput(Wire, frozen=True):
    """Scheduler → Gateway: the deltas one step produced, for routing."""

    deltas: list[RowDelta]


class Drain(Wire, frozen=True):
    """Engine → Gateway (ask): stop admitting; reply once no request is in flight."""


Inbox = Submit | Cancel | StepOutput | Drain


# ---------------------------------------------------------------------------
# One request's stream of deltas: a runtime channel, unbounded (a request emits
# at most ``max_tokens`` deltas, and a slow reader must never stall routing for
# everyone else) and read without yielding (a routed delta is taken at once).


def _ends_stream(item: Any) -> bool:
    """A delta with a finish reason, or a ``Failure`` (which has none), ends a stream."""
    return getattr(item, "finish_reason", True) is not None


def delta_stream() -> tuple[ChannelSender, ChannelReceiver]:
    """One request's stream: the Gateway sends, the caller (``RequestStream``) reads."""
    return channel(math.inf, max_streak=math.inf, is_last=_ends_stream)


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_batch: int = 8
    max_queue: int = 64


class Gateway(Actor[Inbox]):
    name = "gateway"
    inbox_size = 1024

    def __init__(self, cfg: GatewayConfig, info: ModelInfo, scheduler: ActorRef[Any]):
        super().__init__()
        self.cfg = cfg
        self.info = info
        self.scheduler = scheduler
        self.streams: dict[int, ChannelSender] = {}
        self.next_rid = 1
        self.draining = False
        self._drain_waiters: list[Envelope[Any]] = []
        self.rejected = {"overloaded": 0, "invalid": 0, "draining": 0}

    @property
    def max_in_flight(self) -> int:
        return self.cfg.max_batch + self.cfg.max_queue

    def validate(self, msg: Submit) -> None:
        check_limits(msg.tokens, msg.params, self.info)

    async def receive(self, msg: Inbox) -> Any:
        match msg:
            case Submit():
                return self._submit(msg)
            case Cancel():
                send = self.streams.pop(msg.rid, None)
                if send is not None:
                    send.close()
                    self._abort(msg.rid)
                    self._maybe_drained()
            case StepOutput():
                self._route(msg.deltas)
            case Drain():
                self.draining = True
                assert self.current is not None  # receive() runs inside an envelope
                self._drain_waiters.append(self.current)
                self._maybe_drained()
                return DEFER
            case _:
                assert_never(msg)
        return None

    def _submit(self, msg: Submit) -> tuple[int, ChannelReceiver]:
        if self.draining:
            self.rejected["draining"] += 1
            raise EngineDraining("the engine is shutting down")
        try:
            self.validate(msg)
        except InvalidRequest:
            self.rejected["invalid"] += 1
            raise
        if len(self.streams) >= self.max_in_flight:
            self.rejected["overloaded"] += 1
            raise EngineOverloaded(f"{len(self.streams)} requests in flight (max {self.max_in_flight})")
        rid = self.next_rid
        self.next_rid += 1
        send, recv = delta_stream()
        self.streams[rid] = send
        self.scheduler.tell_nowait(Admit(rid=rid, tokens=msg.tokens, params=msg.params, ns=msg.ns))
        return rid, recv

    def _abort(self, rid: int) -> None:
        try:
            self.scheduler.tell_nowait(Abort(rid=rid))
        except EngineDead:
            pass

    def _route(self, deltas: list[RowDelta]) -> None:
        for d in deltas:
            send = self.streams.get(d.rid)
            if send is None:
                continue
            item: Any
            if d.error is not None:
                item = Failure(RequestFailed(d.error))
            else:
                item = Delta(
                    rid=d.rid,
                    text=d.text,
                    token_ids=d.token_ids,
                    logprobs=d.logprobs,
                    finish_reason=d.finish_reason,
                    usage=d.usage,
                )
            try:
                send.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The caller is gone: its row leaves at the next step.
                self.streams.pop(d.rid).close()
                if d.finish_reason is None:
                    self._abort(d.rid)
                continue
            if d.finish_reason is not None or d.error is not None:
                self.streams.pop(d.rid).close()
        self._maybe_drained()

    def _maybe_drained(self) -> None:
        if self._drain_waiters and not self.streams:
            waiters, self._drain_waiters = self._drain_waiters, []
            for env in waiters:
                env.answer(None)

    async def stopping(self, reason: BaseException | None) -> None:
        dead = EngineDead("engine stopped" + (f": {reason!r}" if reason else ""))
        for send in self.streams.values():
            try:
                send.send_nowait(Failure(dead))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            send.close()
        self.streams.clear()
        for env in self._drain_waiters:
            env.answer(Failure(dead))
        self._drain_waiters = []

    def stats(self) -> dict[str, Any]:
        return {
            "in_flight": len(self.streams),
            "max_in_flight": self.max_in_flight,
            "draining": self.draining,
            "rejected": dict(self.rejected),
        }
