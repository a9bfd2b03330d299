"""The actor runtime: bounded inboxes, tell/ask envelopes, supervised shutdown.

An actor is a plain object with a bounded inbox (``inbox``: a deque, the
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
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
from anyio.abc import TaskStatus

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
_NONE = object()


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


class InboxStatistics(NamedTuple):
    """What ``anyio``'s ``MemoryObjectStreamStatistics`` says, for an inbox."""

    current_buffer_used: int
    max_buffer_size: float
    open_send_streams: int
    open_receive_streams: int
    tasks_waiting_send: int
    tasks_waiting_receive: int


class _InboxState:
    __slots__ = ("items", "size", "receiver", "waiting_senders", "send_closed", "recv_closed", "streak")

    def __init__(self, size: float):
        self.items: deque[Any] = deque()
        self.size = size
        self.receiver: asyncio.Future[None] | None = None  # the one reader, while it waits
        # senders waiting for room, oldest first: (their wake-up, their item);
        # a receive moves the oldest one's item into the buffer (anyio's order)
        # a waiting sender's future: None once its item is in, or the error that woke it
        self.waiting_senders: deque[tuple[asyncio.Future[BaseException | None], Any]] = deque()
        self.send_closed = False
        self.recv_closed = False
        self.streak = 0  # items taken by ``receive`` without yielding

    def wake_receiver(self) -> None:
        r = self.receiver
        if r is not None and not r.done():
            r.set_result(None)


MAX_STREAK = 64
"""A reader takes at most this many queued items in a row without yielding."""


class InboxSender:
    """The sending end of an actor's inbox: a bounded deque, the one reader
    woken through a bare asyncio future, waiting senders kept in order. It
    replaces an anyio memory object stream (same exceptions: ``WouldBlock``,
    ``ClosedResourceError``, ``BrokenResourceError``, ``EndOfStream``) whose
    ``receive`` and ``send`` each checkpointed (one event-loop turn) and built
    an event, a waiter and a typing generic per wait: ~5% of a run."""

    __slots__ = ("_state",)

    def __init__(self, state: _InboxState):
        self._state = state

    def send_nowait(self, item: Any) -> None:
        s = self._state
        if s.send_closed:
            raise anyio.ClosedResourceError
        if s.recv_closed:
            raise anyio.BrokenResourceError
        # room in the buffer, or (a zero-size inbox) a reader waiting on it empty
        if len(s.items) < s.size or (not s.items and s.receiver is not None and not s.receiver.done()):
            s.items.append(item)
            s.wake_receiver()
            return
        raise anyio.WouldBlock

    async def send(self, item: Any) -> None:
        """Send, waiting for room (backpressure); a waiter counts in
        ``statistics().tasks_waiting_send`` until its item is in the buffer."""
        try:
            self.send_nowait(item)
            return
        except anyio.WouldBlock:
            pass
        s = self._state
        fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        entry = (fut, item)
        s.waiting_senders.append(entry)
        try:
            await fut
        except BaseException:
            try:
                s.waiting_senders.remove(entry)
            except ValueError:
                pass
            raise
        error = fut.result()
        if error is not None:  # woken by a close, the item not taken
            raise error

    def waiting_room(self) -> bool:
        """True when a send would not wait and the reader is waiting for it."""
        s = self._state
        return s.receiver is not None and not s.receiver.done() and len(s.items) < s.size

    def close(self) -> None:
        s = self._state
        s.send_closed = True
        s.wake_receiver()

    def statistics(self) -> InboxStatistics:
        s = self._state
        waiting_recv = int(s.receiver is not None and not s.receiver.done())
        return InboxStatistics(
            len(s.items), s.size, int(not s.send_closed), int(not s.recv_closed), len(s.waiting_senders), waiting_recv
        )


class InboxReceiver:
    """The actor's end of its inbox (one reader). A queued item is taken
    without yielding (up to ``MAX_STREAK`` in a row, then the reader yields
    once so a busy inbox cannot starve the loop); only an empty inbox waits
    (the cancellation point; a cancelled wait loses nothing)."""

    __slots__ = ("_state",)

    def __init__(self, state: _InboxState):
        self._state = state

    def receive_nowait(self) -> Any:
        s = self._state
        if s.recv_closed:
            raise anyio.ClosedResourceError
        if s.items:
            item = s.items.popleft()
            if s.waiting_senders:
                waiting = self._take_sender()
                if waiting is not _NONE:
                    s.items.append(waiting)
            return item
        if s.waiting_senders:  # a zero-size inbox: take a waiting sender's item directly
            waiting = self._take_sender()
            if waiting is not _NONE:
                return waiting
        if s.send_closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    def _take_sender(self) -> Any:
        """The oldest waiting sender's item, that sender woken (a sender whose
        wait was cancelled meanwhile is skipped: its item is not sent)."""
        waiting = self._state.waiting_senders
        while waiting:
            fut, item = waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return item
        return _NONE

    async def receive(self) -> Any:
        s = self._state
        if s.items and s.streak < MAX_STREAK:
            s.streak += 1
            return self.receive_nowait()
        if s.items:
            s.streak = 0
            await asyncio.sleep(0)
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                pass
            s.streak = 0
            if s.receiver is not None and not s.receiver.done():
                raise RuntimeError("an actor inbox has one reader")
            s.receiver = fut = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if s.receiver is fut:
                    s.receiver = None

    def __aiter__(self) -> InboxReceiver:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """No more reading: waiting senders fail with ``BrokenResourceError``."""
        s = self._state
        s.recv_closed = True
        while s.waiting_senders:
            fut, _ = s.waiting_senders.popleft()
            if not fut.done():
                fut.set_result(anyio.BrokenResourceError())


def inbox(size: float) -> tuple[InboxSender, InboxReceiver]:
    """A bounded actor inbox (``math.inf``: unbounded)."""
    state = _InboxState(size)
    return InboxSender(state), InboxReceiver(state)


class ActorRef(Generic[M]):
    """The sending side of an actor's inbox."""

    def __init__(self, name: str, send: InboxSender):
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

    def statistics(self) -> InboxStatistics:
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
