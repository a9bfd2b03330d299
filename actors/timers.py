"""The runtime's timers: ``Watchdog``, a deadline on each long device call of
an actor (the Scheduler's GPU steps), and ``deadline_timer``, a bare loop timer
that resolves a future (a reader's wait with a deadline: a server's keep-alive,
``actors.channel.ChannelReceiver.wait``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from engine.errors import EngineDead
from engine.ports import Clock


class Watchdog:
    """A deadline on each long device call of an actor (the Scheduler's GPU
    steps): a call still running ``timeout_s`` after it began kills the actor
    with ``EngineDead`` (its supervisor then fails every waiter).

    ``run(body)`` runs the actor's loop under it; ``with watchdog.armed(n,
    cost_s): await call`` guards call ``n``. On asyncio: one cancel scope for
    the actor's life and, per call, a bare loop timer at its deadline,
    cancelled when the call ends, instead of a ``fail_after`` per step (a
    scope, a generator context and the same timer: docs/sims.md); it fires
    at the instant that ``fail_after`` did. (A timer that outlived its call
    would stop the virtual clock at an instant of its own and move every
    later float time.) Elsewhere: a ``fail_after`` per call. No
    ``timeout_s``: no deadline.
    """

    def __init__(self, timeout_s: float | None, clock: Clock, *, what: str = "call", exact_cost: bool = False):
        self.timeout_s = timeout_s
        self.clock = clock
        self.what = what
        # The device's calls take exactly their cost (the fake GPU's InlineDevice):
        # a call that ends a clock tick before its deadline cannot hang, and
        # gets no timer.
        self.exact_cost = exact_cost
        self._loop: asyncio.AbstractEventLoop | None = None  # set by ``run`` on asyncio
        self._scope: anyio.CancelScope | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fail_after: Any = None  # off asyncio: the call's ``fail_after``
        self._n = 0  # the call being armed
        self._cost_s = 0.0
        self._timed = 0  # the call the timer in flight is for
        self._hung: int | None = None  # the call the watchdog gave up on

    async def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` (the actor's loop); raise ``EngineDead`` if a call hung."""
        if not self.timeout_s:
            return await body()
        loop = asyncio._get_running_loop()
        if loop is None:  # not asyncio: a ``fail_after`` per call (``__enter__``)
            return await body()
        self._loop = loop
        try:
            with anyio.CancelScope() as self._scope:
                await body()
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if self._hung is not None:
            raise EngineDead(f"{self.what} {self._hung} hung past {self.timeout_s}s")

    def armed(self, n: int, cost_s: float) -> Watchdog:
        """The guard for call ``n``, expected to take ``cost_s``."""
        self._n, self._cost_s = n, cost_s
        return self

    def __enter__(self) -> Watchdog:
        loop = self._loop
        if loop is not None:
            now = self.clock.now()
            assert self.timeout_s is not None  # run() sets _loop only with a timeout
            deadline = now + self.timeout_s
            # asyncio's private _clock_resolution: the granularity its timers fire at
            if not (self.exact_cost and now + self._cost_s + loop._clock_resolution < deadline):  # type: ignore[attr-defined]
                self._timed = self._n
                self._timer = loop.call_at(deadline, self._fire)
        elif self.timeout_s:
            self._fail_after = anyio.fail_after(self.timeout_s)
            self._fail_after.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cm, self._fail_after = self._fail_after, None
        if cm is not None:
            try:
                cm.__exit__(exc_type, exc, tb)
            except TimeoutError:
                exc_type = TimeoutError
        if exc_type is not None and issubclass(exc_type, TimeoutError):
            raise EngineDead(f"{self.what} {self._n} hung past {self.timeout_s}s") from None

    def _fire(self) -> None:
        """The timer: the call in flight reached its deadline."""
        self._timer = None
        self._hung = self._timed
        assert self._scope is not None  # the timer is set only inside run's scope
        self._scope.cancel()


def deadline_timer(loop: asyncio.AbstractEventLoop, delay: float, fut: asyncio.Future[None]) -> asyncio.TimerHandle:
    """Resolve ``fut`` (with None) after ``delay`` seconds unless it is done
    by then; cancel the handle when the wait ends. A bare loop timer: no
    cancel scope, no task lookup."""
    return loop.call_later(delay, _resolve, fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
