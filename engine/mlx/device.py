"""The MLX thread with a cheaper hop per step.

``engine.device.ThreadDevice.run`` goes through ``ThreadPoolExecutor.submit``
and ``asyncio.wrap_future``: a ``concurrent.futures.Future``, its condition
variable, a done-callback and then ``call_soon_threadsafe``. The Scheduler
makes one such hop per decode step, so on the bundled model (about 1 ms a
token) it is a visible share of every token (docs/bench/engine.md). Here the
thread reads jobs from a ``SimpleQueue`` and settles an asyncio future with
one ``call_soon_threadsafe``; ``submit``/``call`` (loading, tests, the
drafter) go through the same queue, so there is still exactly one MLX thread.

``after_each`` runs on the thread right after each call's result has been
handed back: the backend's ``run_ahead`` uses it to compute the next decode
step while the event loop consumes the last one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.device import ThreadDevice

T = TypeVar("T")
log = logging.getLogger("ember.mlx")


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux, 15 bytes), so
    ``top -H``, ``perf``, ``py-spy`` and /proc show which thread is the MLX
    thread; Python 3.11 names only its own ``Thread`` object. Elsewhere, or if
    libc refuses, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def release_thread_streams() -> None:
    """Destroy the MLX streams this thread created, while it still holds the GIL.

    Left to the thread's C++ thread-local destructors, they run after
    ``Thread.join`` has returned; if the main thread is finalizing the
    interpreter by then, the destructor's wait for the GIL ends the thread
    by a forced unwind through a noexcept frame: "terminate called without
    an active exception" and SIGABRT at exit, in ~2 of 3 runs of a script
    that closes an engine and returns (tests/engine/test_mlx_thread_exit.py).
    MLX's advice is ``clear_streams`` at the end of each thread
    (ml-explore/mlx#3395, #4110). A thread that never imported MLX skips it.
    """
    mx = sys.modules.get("mlx.core")
    if mx is not None and hasattr(mx, "clear_streams"):
        mx.clear_streams()


def _deliver_result(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return  # the caller stopped waiting; the thread finished the call anyway
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class MLXThread(ThreadDevice):
    """Same interface as ``ThreadDevice`` (``submit``, ``call``, ``run``, ``close``)."""

    def __init__(self, name: str = "ember-mlx", init: Callable[[], None] | None = None):
        # Not ThreadDevice.__init__: its pool is replaced by one plain thread.
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._init = init
        self.after_each: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._closed = False
        self._thread.start()
        self.thread_ident = self._thread.ident

    def _serve(self) -> None:
        name_os_thread(self._thread.name)
        if self._init is not None:
            self._init()
        while True:
            job = self._jobs.get()
            if job is None:
                release_thread_streams()
                return
            fn, args, done = job
            try:
                value, ok = fn(*args), True
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                value, ok = exc, False
            done(ok, value)
            if self.after_each is not None:
                try:
                    self.after_each()
                except Exception:  # the hook reports its own failures; the thread must live
                    log.exception("[mlx] after_each hook failed")

    def idle(self) -> bool:
        """No call is waiting for the thread (a hint: one may arrive right after)."""
        return self._jobs.empty()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the MLX thread is closed")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def done(ok: bool, value: Any) -> None:
            fut.set_result(value) if ok else fut.set_exception(value)

        self._jobs.put((fn, args, done))
        return fut

    async def run(self, fn: Callable[..., T], *args: Any, cost_s: float = 0.0) -> T:
        if self._closed:
            raise RuntimeError("the MLX thread is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def done(ok: bool, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(_deliver_result, fut, ok, value)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        self._jobs.put((fn, args, done))
        return await fut

    def close(self) -> None:
        """Finish the queued calls, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()
