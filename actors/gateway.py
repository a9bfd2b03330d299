"""Gateway: the engine's front door.

Validates requests, applies backpressure (a bounded number of requests in
flight; over it a clear ``EngineOverloaded``, never an unbounded queue),
streams each request's deltas back on that request's own stream, turns a
caller that goes away into an ``Abort``, and reports a request's failure on
its stream only. While draining it admits nothing new.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, assert_never

import anyio
import msgspec

from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure
from actors.scheduler import Abort, Admit, RowDelta
from engine.errors import EngineDead, EngineDraining, EngineOverloaded, InvalidRequest, RequestFailed
from engine.limits import check_limits
from engine.ports import ModelInfo
from engine.types import Delta, SamplingParams

log = logging.getLogger("ember.gateway")


# ---------------------------------------------------------------------------
# Messages the Gateway accepts.


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Caller → Gateway (ask): admit a request; the reply is ``(rid, stream)``
    or an error (``InvalidRequest``, ``EngineOverloaded``, ``EngineDraining``)."""

    tokens: list[int]
    params: SamplingParams
    ns: str = ""


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Caller → Gateway: the caller stopped reading ``rid``'s stream."""

    rid: int


class StepOutput(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler → Gateway: the deltas one step produced, for routing."""

    deltas: list[RowDelta]


class Drain(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Engine → Gateway (ask): stop admitting; reply once no request is in flight."""


Inbox = Submit | Cancel | StepOutput | Drain


# ---------------------------------------------------------------------------
# One request's stream of deltas.


class _Channel:
    __slots__ = ("items", "waiter", "send_closed", "recv_closed", "lazy")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.send_closed = False
        self.recv_closed = False
        self.lazy = False  # wake the reader only for a last delta, a failure or the close

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class DeltaSender:
    """The Gateway's end of one request's stream: unbounded (a request emits
    at most ``max_tokens`` deltas, and a slow reader must never stall routing
    for everyone else). Raises like an anyio memory stream: ``BrokenResourceError``
    once the reader has gone, ``ClosedResourceError`` after ``close``."""

    __slots__ = ("_ch",)

    def __init__(self, ch: _Channel):
        self._ch = ch

    def send_nowait(self, item: Any) -> None:
        ch = self._ch
        if ch.send_closed:
            raise anyio.ClosedResourceError
        if ch.recv_closed:
            raise anyio.BrokenResourceError
        ch.items.append(item)
        if not ch.lazy or getattr(item, "finish_reason", True) is not None:  # a Failure has none: it wakes
            ch.wake()

    def close(self) -> None:
        self._ch.send_closed = True
        self._ch.wake()


class DeltaReceiver:
    """The caller's end (``RequestStream`` reads it). Why not an anyio memory
    object stream: its ``receive`` checkpoints before every item and builds
    a waiter and an event per call, two wake-ups and most of the cost of each
    streamed token. Here a routed delta is taken without yielding, and only
    an empty stream waits (the cancellation point; a cancelled wait loses
    nothing, the delta stays queued), on a bare asyncio future: the engine
    runs on asyncio only, and an anyio Event is an asyncio Event, a future
    and a backend lookup per wait."""

    __slots__ = ("_ch",)

    def __init__(self, ch: _Channel):
        self._ch = ch

    def receive_nowait(self) -> Any:
        ch = self._ch
        if ch.recv_closed:
            raise anyio.ClosedResourceError
        if ch.items:
            return ch.items.popleft()
        if ch.send_closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> Any:
        ch = self._ch
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                pass
            ch.waiter = fut = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if ch.waiter is fut:
                    ch.waiter = None

    async def wait(self, timeout: float) -> bool:
        """Wait until something is queued (a delta, a failure, the end), at most
        ``timeout`` seconds; False when the time ran out first. Takes nothing.
        A bare loop timer instead of an anyio cancel scope: a streamed token
        waits once, and the scope's enter and exit (task and backend lookups,
        a deadline, its own timer) cost about as much as the rest of that
        token's path through the loop (py-spy of ``ember serve`` at 8 streams).
        Cancel-safe like ``receive``: a cancelled wait loses nothing."""
        ch = self._ch
        if ch.items or ch.send_closed or ch.recv_closed:
            return True
        loop = asyncio.get_running_loop()
        ch.waiter = fut = loop.create_future()
        timer = loop.call_later(timeout, _time_up, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if ch.waiter is fut:
                ch.waiter = None
        return bool(ch.items or ch.send_closed or ch.recv_closed)

    def wake_at_end(self) -> None:
        """Wake this reader only when the stream ends (a delta with a finish
        reason, a failure, or the close), not for every delta: for a caller
        that wants the whole answer (the simulator's clients), one wake-up
        per request instead of one per token. Deltas still queue as routed."""
        self._ch.lazy = True

    def close(self) -> None:
        self._ch.recv_closed = True
        self._ch.items.clear()


def _time_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def delta_stream() -> tuple[DeltaSender, DeltaReceiver]:
    ch = _Channel()
    return DeltaSender(ch), DeltaReceiver(ch)


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
        self.streams: dict[int, DeltaSender] = {}
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

    def _submit(self, msg: Submit) -> tuple[int, DeltaReceiver]:
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
