"""The dedicated compute thread that owns MLX.

MLX streams are thread-local (mlx-lm's ``generation_stream``), so every array
operation of a model must happen on one thread. The event loop hands each
backend call to that thread and awaits the result without blocking, so other
coroutines keep running while a forward pass computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ThreadDevice:
    exact_cost = False  # real time: a run takes what the hardware takes (engine.ports.Device)

    def __init__(self, name: str = "ember-mlx", init: Callable[[], None] | None = None):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)
        self.thread_ident: int | None = None
        self.submit(lambda: setattr(self, "thread_ident", threading.get_ident())).result()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking call from a non-loop thread (loading, tests)."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any, cost_s: float = 0.0) -> T:
        # A cancelled caller stops waiting; the thread still finishes the call,
        # and ``close`` waits for it before the backend is dropped.
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
