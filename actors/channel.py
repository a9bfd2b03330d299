"""A one-reader channel: an actor's inbox, and one request's stream of deltas.

A deque (bounded, or ``math.inf``), the one reader woken through a bare asyncio
future, senders waiting for room kept in order. It stands in for an anyio
memory object stream, with the same exceptions (``WouldBlock``,
``ClosedResourceError`` after ``close``, ``BrokenResourceError`` once the
reader has gone, ``EndOfStream``): that stream's ``receive`` and ``send`` each
checkpointed (one event-loop turn) and built an event, a waiter and a typing
generic per wait (what that cost: docs/sims.md, "Fourth round", and
docs/bench/vs-mlx-lm.md). The actors' inboxes (``actors.runtime.inbox``) and
the Gateway's delta streams (``actors.gateway.delta_stream``) are this one type.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio

from actors.timers import deadline_timer

_NONE = object()


class ChannelStatistics(NamedTuple):
    """What ``anyio``'s ``MemoryObjectStreamStatistics`` says, for a channel."""

    current_buffer_used: int
    max_buffer_size: float
    open_send_streams: int
    open_receive_streams: int
    tasks_waiting_send: int
    tasks_waiting_receive: int


def _always(item: Any) -> bool:
    return True


class _ChannelState:
    __slots__ = (
        "items",
        "size",
        "receiver",
        "waiting_senders",
        "send_closed",
        "recv_closed",
        "streak",
        "max_streak",
        "lazy",
        "is_last",
    )

    def __init__(self, size: float, max_streak: float, is_last: Callable[[Any], bool]):
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
        self.max_streak = max_streak
        self.lazy = False  # wake the reader only for an item that ``is_last``, or the close
        self.is_last = is_last

    def wake_receiver(self) -> None:
        r = self.receiver
        if r is not None and not r.done():
            r.set_result(None)


MAX_STREAK = 64
"""An actor takes at most this many queued messages in a row without yielding."""


class ChannelSender:
    """The sending end of a channel (any number of senders share it)."""

    __slots__ = ("_state",)

    def __init__(self, state: _ChannelState):
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
            if not s.lazy or s.is_last(item):
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

    def statistics(self) -> ChannelStatistics:
        s = self._state
        waiting_recv = int(s.receiver is not None and not s.receiver.done())
        return ChannelStatistics(
            len(s.items), s.size, int(not s.send_closed), int(not s.recv_closed), len(s.waiting_senders), waiting_recv
        )


class ChannelReceiver:
    """The reading end of a channel (one reader). A queued item is taken
    without yielding (up to ``max_streak`` in a row, then the reader yields
    once so a busy inbox cannot starve the loop); only an empty channel waits
    (the cancellation point; a cancelled wait loses nothing, the item stays
    queued), on a bare asyncio future: the engine runs on asyncio only, and an
    anyio Event is an asyncio Event, a future and a backend lookup per wait."""

    __slots__ = ("_state",)

    def __init__(self, state: _ChannelState):
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
        if s.items and s.streak < s.max_streak:
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
                raise RuntimeError("a channel has one reader")
            s.receiver = fut = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if s.receiver is fut:
                    s.receiver = None

    async def wait(self, timeout: float) -> bool:
        """Wait until something is queued (an item, the end), at most
        ``timeout`` seconds; False when the time ran out first. Takes nothing.
        A bare loop timer (``actors.timers.deadline_timer``) instead of an
        anyio cancel scope: a streamed token waits once, and the scope's enter
        and exit were a large part of that token's path through the loop
        (docs/bench/vs-mlx-lm.md). Cancel-safe like ``receive``."""
        s = self._state
        if s.items or s.send_closed or s.recv_closed:
            return True
        loop = asyncio.get_running_loop()
        s.receiver = fut = loop.create_future()
        timer = deadline_timer(loop, timeout, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if s.receiver is fut:
                s.receiver = None
        return bool(s.items or s.send_closed or s.recv_closed)

    def wake_at_end(self) -> None:
        """Wake this reader only for an item that ends the stream (the
        channel's ``is_last``) or the close, not for every item: for a caller
        that wants a request's whole answer (the simulator's clients), one
        wake-up per request instead of one per token. Items still queue."""
        self._state.lazy = True

    def __aiter__(self) -> ChannelReceiver:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """No more reading: what is queued is dropped, and waiting senders
        fail with ``BrokenResourceError``."""
        s = self._state
        s.recv_closed = True
        s.items.clear()
        while s.waiting_senders:
            fut, _ = s.waiting_senders.popleft()
            if not fut.done():
                fut.set_result(anyio.BrokenResourceError())


def channel(
    size: float, *, max_streak: float = MAX_STREAK, is_last: Callable[[Any], bool] = _always
) -> tuple[ChannelSender, ChannelReceiver]:
    """A one-reader channel of ``size`` items (``math.inf``: unbounded): an
    actor's inbox, or one request's stream of deltas. ``max_streak``: items
    a reader takes in a row before it yields; ``is_last``: the items that wake
    a reader that asked to be woken only at the end (``wake_at_end``)."""
    state = _ChannelState(size, max_streak, is_last)
    return ChannelSender(state), ChannelReceiver(state)
