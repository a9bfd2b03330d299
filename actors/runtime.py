"""The actor runtime: inboxes, tell/ask envelopes, supervised shutdown.

An actor is a plain object with a bounded inbox (an ``actors.channel``: a deque, the
reader and waiting senders woken through bare asyncio futures) and one task
that feeds each message to ``receive``. Senders hold an ``ActorRef``:

* ``tell_nowait`` never blocks (admission, abort and snapshot paths use it);
  a full inbox raises ``InboxFull`` instead of making the sender a waiter.
* ``tell`` awaits space (backpressure for paths that may wait).
* ``ask`` is tell plus a one-shot reply slot (a future) carried in the envelope.

Failures travel back to the asker as values (``Failure``), never as a raw
exception crossing an actor boundary. When an actor stops (clean stop or a
crash) it fails every ask still queued in its inbox with ``EngineDead``, so no
caller hangs on a reply that will never come.

The runtime's other parts: ``actors.channel`` (the inbox's type, which is
also a request's stream of deltas from the Gateway to its caller, with a
reader's deadline for a server's keep-alive) and ``actors.timers`` (a
deadline on each of an actor's device calls: the Scheduler's GPU steps).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskStatus

from actors.channel import ChannelReceiver, ChannelSender, ChannelStatistics, channel
from engine.errors import EngineDead, EngineError

log = logging.getLogger("ember.actors")

M = TypeVar("M")


class InboxFull(EngineError):
    """A ``tell_nowait`` found the receiver's bounded inbox full."""


DEFER = object()
"""Returned by ``receive`` to answer an ask later via ``Actor.current.answer``."""


@dataclass(frozen=True, slots=True)
class Failure:
    """An error travelling back to an asker (or down a request stream) as a value."""

    exc: BaseException


class _Reply:
    """The one-shot reply slot of an ``ask``: a bare asyncio future (the
    engine's actors run on asyncio; an anyio memory stream per ask was two
    objects, a checkpoint and an event per reply). ``send_nowait`` and
    ``close`` behave like that stream's: a reply to an asker that went away
    (its wait was cancelled) is dropped; ``close`` without a value tells the
    asker that nobody will answer."""

    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future[Any]):
        self.fut = fut

    def send_nowait(self, value: Any) -> None:
        if self.fut.done():
            raise anyio.BrokenResourceError
        self.fut.set_result(value)

    def close(self) -> None:
        if not self.fut.done():
            self.fut.set_result(_UNANSWERED)


_UNANSWERED = object()


@dataclass(slots=True)
class Envelope(Generic[M]):
    """A message plus the optional one-shot reply slot of an ``ask``."""

    msg: M
    reply: _Reply | None = None

    def answer(self, value: Any) -> None:
        """Send the reply (a value or a ``Failure``) and close the reply slot."""
        if self.reply is None:
            return
        try:
            self.reply.send_nowait(value)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the asker went away; nobody to tell
        finally:
            self.reply.close()


def inbox(size: float) -> tuple[ChannelSender, ChannelReceiver]:
    """A bounded actor inbox (``math.inf``: unbounded)."""
    return channel(size)


class ActorRef(Generic[M]):
    """The sending side of an actor's inbox."""

    def __init__(self, name: str, send: ChannelSender):
        self.name = name
        self._send = send

    def tell_nowait(self, msg: M) -> None:
        try:
            self._send.send_nowait(Envelope(msg))
        except anyio.WouldBlock:
            raise InboxFull(f"{self.name} inbox is full") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EngineDead(f"{self.name} has stopped") from None

    async def tell(self, msg: M) -> None:
        """Send, waiting for room. When the receiver is waiting on its inbox
        and there is room, the message is handed over without yielding (the
        receiver runs at the next turn; the sender's own next await yields);
        otherwise the sender yields once first, as a checkpoint, then waits
        for room if it must."""
        send = self._send
        try:
            if send.waiting_room():
                send.send_nowait(Envelope(msg))
                return
            await asyncio.sleep(0)
            await send.send(Envelope(msg))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EngineDead(f"{self.name} has stopped") from None

    async def ask(self, msg: M, *, nowait: bool = False) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        env = Envelope(msg, _Reply(fut))
        send = self._send
        try:
            if nowait or send.waiting_room():
                send.send_nowait(env)
            else:
                await asyncio.sleep(0)
                await send.send(env)
        except anyio.WouldBlock:
            raise InboxFull(f"{self.name} inbox is full") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EngineDead(f"{self.name} has stopped") from None
        value = await fut
        if value is _UNANSWERED:
            raise EngineDead(f"{self.name} stopped before answering")
        if isinstance(value, Failure):
            raise value.exc
        return value

    def statistics(self) -> ChannelStatistics:
        """The inbox's statistics (tests assert nothing waits on send)."""
        return self._send.statistics()


class Actor(Generic[M]):
    """Base class: subclasses set ``name`` and implement ``receive``.

    ``receive`` returns the reply for an ask (ignored for a tell). Raising an
    ``EngineError`` subclass answers that ask with the error and keeps the
    actor alive (a per-request failure); any other exception is a bug and
    crashes the actor, which the engine's supervisor turns into ``EngineDead``
    for every waiter.
    """

    name = "actor"
    inbox_size = 64

    def __init__(self) -> None:
        size = math.inf if self.inbox_size is None else self.inbox_size
        self._inbox_send, self._inbox_recv = inbox(size)
        self.ref: ActorRef[M] = ActorRef(self.name, self._inbox_send)
        self.stopped = anyio.Event()
        self.current: Envelope[M] | None = None  # the envelope being handled
        # What stopped the whole engine, if anything (the Engine sets it): an actor
        # cancelled because another crashed tells its waiters that cause instead
        # of its own cancellation.
        self.cause: Callable[[], BaseException | None] | None = None

    async def started(self) -> None:
        """Hook run inside the actor task before the first message."""

    async def stopping(self, reason: BaseException | None) -> None:
        """Hook run when the actor stops; ``reason`` is the crash, if any."""

    async def receive(self, msg: M) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        reason: BaseException | None = None
        try:
            await self.started()
            task_status.started()
            await self.main()
        except BaseException as exc:  # noqa: BLE001 - we re-raise after failing waiters
            reason = exc
            raise
        finally:
            if isinstance(reason, anyio.get_cancelled_exc_class()) and self.cause is not None:
                reason = self.cause() or reason
            with anyio.CancelScope(shield=True):
                self._fail_queued(reason)
                try:
                    await self.stopping(reason)
                finally:
                    self.stopped.set()

    async def main(self) -> None:
        """The actor's loop: one message at a time until the inbox closes."""
        # The inbox is closed by ``_fail_queued`` (not an ``async with``), so the
        # asks still buffered at a crash are answered instead of dropped.
        async for env in self._inbox_recv:
            await self._dispatch(env)

    async def _dispatch(self, env: Envelope[M]) -> None:
        self.current = env
        try:
            value = await self.receive(env.msg)
        except EngineError as exc:
            env.answer(Failure(exc))
            return
        except BaseException as exc:
            env.answer(Failure(EngineDead(f"{self.name} crashed: {exc!r}")))
            raise
        if value is not DEFER:
            env.answer(value)

    def _fail_queued(self, reason: BaseException | None) -> None:
        """Close the inbox and fail every ask still queued in it."""
        self._inbox_send.close()
        dead = EngineDead(f"{self.name} stopped" + (f": {reason!r}" if reason else ""))
        while True:
            try:
                env = self._inbox_recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            env.answer(Failure(dead))
        self._inbox_recv.close()

    def stop(self) -> None:
        """Ask the actor to finish: it handles what is queued, then stops."""
        self._inbox_send.close()
