"""One model across processes on ``mx.distributed``: an SPMD engine.

    mlx.launch -n 2 --backend ring -- ember serve --model M --distributed tensor
    mlx.launch -n 2 --backend ring -- ember serve --model M --distributed pipeline

Every rank loads the model with mlx-lm's ``sharded_load`` (``tensor``:
``model.shard(group)``; ``pipeline``: the model's ``PipelineMixin`` stages).
Rank 0 runs the whole engine (HTTP, Gateway, Scheduler) on a ``LeaderBackend``;
every other rank runs ``run_follower``: no HTTP, no Scheduler, only an
``MLXBackend`` over its shard. Before rank 0 executes a step plan it
broadcasts the plan's msgpack bytes (``RankLink``: an ``all_sum`` of a header
and of a byte buffer where only rank 0 contributes, as ``mlx_lm.server`` shares
its requests); each follower decodes the same ``StepPlan`` and calls the same
``MLXBackend.step`` with it. The backend is deterministic given its plans
(row seeds come from the engine seed and the row id), so every rank takes the
same path through ``step`` and issues the model's collectives (the tensor
shards' ``all_sum``, the pipeline's send/recv/all_gather) in the same order,
and every rank's KV caches stay in lock-step.

Off in this mode: running ahead (``MLXBackend.run_ahead``): it computes a
step on the MLX thread when the thread is idle, a timing decision each rank
would take differently, and a collective issued by one rank alone deadlocks
the group.

The tiers work. The RAM tier in lock-step: rank 0 names every cache it keeps
(``TrackedCache``: the row id it closed from, or ``checkpoint_names`` for a
checkpoint), each follower keeps its own shard of the same cache under that
name, a hit goes on the wire as the name, and the names rank 0 lets go of are
sent with the next plan. The SSD tier (``actors.distributed_tier``): each rank
writes and reads its own shard's files when rank 0 says so, a write durable
and a restore served only when every rank's part succeeded.

Speculation works, unlike ``mlx_lm.server`` (which refuses draft models when
distributed): the drafter (a draft model, whole and unsharded, or n-gram
lookup) runs on rank 0 alone and makes no collective call; its windows reach
the target as ``VerifyRow``s inside the broadcast plans, and the trims after
a verdict too, so every rank verifies and rolls back the same tokens.

A rank that dies: the ring backend fails every pending collective with
``RuntimeError("[ring] connection to a peer was lost")`` about a second after
a peer's socket closes (measured), so the step in flight raises, the Scheduler
dies and the engine is ``engine_dead`` (``/health`` 503, every open request
ends with an error). While idle, rank 0 sends a heartbeat every
``HEARTBEAT_S`` seconds, so a peer lost between requests is noticed within
``HEARTBEAT_S`` plus that second; a peer that hangs without closing its socket
is caught by the Scheduler's step watchdog (``step_timeout_s``, 60 s by
default in this mode). A follower whose leader goes silent for
``FOLLOWER_SILENCE_S`` exits (status 3).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from engine.config import EngineConfig
from engine.mlx.device import MLXThread, name_os_thread
from engine.ports import OpenRow, StepPlan

log = logging.getLogger("ember.distributed")

MODES = ("tensor", "pipeline")
HEARTBEAT_S = 1.0
FOLLOWER_SILENCE_S = 30.0
DEFAULT_STEP_TIMEOUT_S = 60.0

_STOP, _PLAN, _BEAT, _TIER = 0, 1, 2, 3  # _TIER: an SSD-tier op (actors.distributed_tier)


def group() -> Any:
    import mlx.core as mx

    return mx.distributed.init()


def rank() -> int:
    """This process's rank (0 when not launched by ``mlx.launch``)."""
    return group().rank()


class RankLink:
    """Rank 0 broadcasts byte messages to every other rank over ``all_sum``.

    A message is a header ``[kind, length]`` then, for a plan, ``length``
    bytes; the other ranks contribute zeros, so the sum is rank 0's bytes.
    Every call is a collective: all ranks must make the same calls in the
    same order (rank 0 ``send``/``beat``/``stop``, the others ``recv``)."""

    def __init__(self, grp: Any):
        self.group = grp
        self.sent = 0
        self.bytes = 0
        self.tier_ops = 0

    def _all_sum(self, x: Any) -> Any:
        import mlx.core as mx

        out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def _header(self, kind: int, length: int) -> None:
        import mlx.core as mx

        self._all_sum(mx.array([kind, length], dtype=mx.int32))

    def send(self, data: bytes, *, tier: bool = False) -> None:
        import mlx.core as mx

        self._header(_TIER if tier else _PLAN, len(data))
        self._all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)))
        if tier:
            self.tier_ops += 1
            return
        self.sent += 1
        self.bytes += len(data)

    def beat(self) -> None:
        self._header(_BEAT, 0)

    def agree(self, ok: bool) -> bool:
        """Every rank says whether its part succeeded; True only if all did."""
        import mlx.core as mx

        return int(self._all_sum(mx.array([0 if ok else 1], dtype=mx.int32)).item()) == 0

    def stop(self) -> None:
        self._header(_STOP, 0)

    def recv(self) -> tuple[int, bytes]:
        import mlx.core as mx

        kind, length = (int(v) for v in self._all_sum(mx.zeros((2,), dtype=mx.int32)).tolist())
        if kind not in (_PLAN, _TIER):
            return kind, b""
        data = self._all_sum(mx.zeros((length,), dtype=mx.uint8))
        return kind, bytes(np.array(data, copy=False))


_encode = msgspec.msgpack.Encoder().encode
_decode_wire = msgspec.msgpack.Decoder(tuple[StepPlan, list[int]]).decode


class TrackedCache(list):
    """A closed row's cache on rank 0, named by the row it closed from
    (``origin``). Every follower keeps its own shard of the same cache under
    that name, so a plan can refer to it by the name; when rank 0 lets go of
    it (the RAM tier evicted or replaced it) the name is sent to the
    followers to drop theirs."""

    __slots__ = ("origin", "__weakref__")
    origin: int


CHECKPOINT_NAMES = 1 << 40  # above any row id (the names of closed caches); restores are negative


def checkpoint_names(plan_no: int, rids: Any) -> dict[int, int]:
    """The names of the checkpoints plan number ``plan_no`` (1-based, counted
    alike by rank 0 and every follower) asks for: from the plan alone, so the
    ranks agree without a word on the wire."""
    return {rid: CHECKPOINT_NAMES + (plan_no << 16) + i for i, rid in enumerate(sorted(rids))}


def encode_wire(plan: StepPlan, drops: list[int]) -> bytes:
    """The plan with each prefix cache replaced by its name, and the names to drop."""
    from engine.mlx.cache_views import CachePrefix

    if any(o.cache is not None for o in plan.open):
        opened = []
        for o in plan.open:
            if o.cache is None:
                opened.append(o)
                continue
            src = o.cache.cache if isinstance(o.cache, CachePrefix) else o.cache
            if not isinstance(src, TrackedCache):
                # not a cache every rank holds (an SSD restore is one: it is
                # tracked, actors.distributed_tier): refuse rather than let the ranks diverge
                raise RuntimeError("a step plan with a cache the other ranks do not hold cannot be shared")
            opened.append(OpenRow(o.rid, o.sampling, src.origin, o.cached, o.prefix))
        plan = dataclasses.replace(plan, open=opened)
    return _encode((plan, drops))


# ---------------------------------------------------------------------------
# Loading (every rank).


def load_sharded(config: EngineConfig) -> Any:
    """An ``MLXBackend`` over this rank's shard of ``config.model``; call on the
    thread that will run its steps."""
    from mlx_lm.utils import sharded_load

    from engine.mlx.backend import MLXBackend
    from engine.mlx.model_identity import tokenizer_hash, weights_digest
    from engine.models import resolve_model

    path = resolve_model(config.model)
    grp = group()
    tensor = grp if config.distributed == "tensor" else None
    pipeline = grp if config.distributed == "pipeline" else None
    model, tokenizer, model_config = sharded_load(str(path), pipeline, tensor, return_config=True)
    if pipeline is not None:
        model = EvalEachForward(model)
    # No W.T pre-transposition (engine.mlx.cpu_layout): it knows nn.Linear, not
    # mlx-lm's sharded linears.
    backend = MLXBackend(
        model,
        tokenizer,
        model_config,
        model_id=config.model_name or str(config.model),
        tokenizer_hash=tokenizer_hash(path),
        engine_seed=config.seed,
        pipeline=False,  # no running ahead: see the module docstring
        weights_digest=weights_digest(path) + f":{config.distributed}{grp.rank()}/{grp.size()}",
        prefill_together=config.batch_prefill,
    )
    backend.counters["rank"] = grp.rank()
    backend.counters["ranks"] = grp.size()
    return backend


class EvalEachForward:
    """A pipeline stage's model whose every forward is evaluated at once.

    A step may build several forwards (the decode batch, rows joining it)
    and evaluate them together. Tensor-parallel ranks build the same graph,
    so MLX walks it in the same order everywhere; pipeline stages build
    different graphs (rank 0 receives and runs the last layers, rank 1 runs
    the first and sends), and two forwards' send/recv/all_gather evaluated in
    one ``mx.eval`` paired up across forwards: four concurrent requests on a
    2-stage qwen2 came out as garbage (tests/sims/test_distributed.py). Evaluating
    each forward before the next one is built orders them the same on every rank."""

    def __init__(self, model: Any):
        self.__dict__["_model"] = model

    def __call__(self, *args: Any, **kw: Any) -> Any:
        import mlx.core as mx

        out = self._model(*args, **kw)
        mx.eval(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)


# ---------------------------------------------------------------------------
# Rank 0.


class LeaderBackend:
    """``MLXBackend`` on rank 0: each step's plan goes to the followers first."""

    def __init__(self, inner: Any, link: RankLink):
        self.inner = inner
        self.link = link
        self.lost: BaseException | None = None
        self.on_lost: Callable[[BaseException], None] | None = None
        # names of closed caches rank 0 no longer holds (appended by finalizers on any thread)
        self._dropped: collections.deque[int] = collections.deque()
        self.tracked = 0
        self.plans = 0  # plans sent: every follower counts them alike (checkpoint_names)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, plan: StepPlan) -> Any:
        if self.lost is not None:
            raise RuntimeError(f"a rank was lost: {self.lost}")
        drops = []
        while self._dropped:
            drops.append(self._dropped.popleft())
        data = encode_wire(plan, drops)  # outside the try: a refused plan is not a lost rank
        try:
            self.link.send(data)
        except RuntimeError as exc:
            self._lose(exc)
            raise
        self.plans += 1
        res = self.inner.step(plan)
        for rid, cache in res.closed.items():
            res.closed[rid] = self._track(cache, rid)
        # checkpoints (caches that cannot be trimmed back: sliding windows, SSM
        # state) are RAM-tier entries too; every rank names them after the plan
        for rid, name in checkpoint_names(self.plans, plan.checkpoint).items():
            if rid in res.checkpoints:
                res.checkpoints[rid] = self._track(res.checkpoints[rid], name)
            else:  # copied on the followers but not here: let theirs go
                self._dropped.append(name)
        return res

    def _track(self, cache: Any, name: int) -> TrackedCache:
        tracked = TrackedCache(cache)
        tracked.origin = name
        weakref.finalize(tracked, self._dropped.append, name)
        self.tracked += 1
        return tracked

    def beat(self) -> None:
        if self.lost is not None:
            return
        try:
            self.link.beat()
        except RuntimeError as exc:
            self._lose(exc)

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
            log.error("[distributed] lost a rank: %s", exc)
            if self.on_lost is not None:
                self.on_lost(exc)

    def attach_engine(self, engine: Any, loop: Any) -> None:
        """A rank lost while the engine is idle kills the engine like a failed step."""

        def dead(exc: BaseException) -> None:
            loop.call_soon_threadsafe(engine.kill, RuntimeError(f"a rank was lost: {exc}"))  # no drain: a rank is gone

        self.on_lost = dead

    def stats(self) -> dict[str, Any]:
        return {
            **self.inner.stats(),
            "plans_sent": self.link.sent,
            "plan_bytes": self.link.bytes,
            "caches_shared": self.tracked,
            "tier_ops": self.link.tier_ops,
            "caches_dropped_pending": len(self._dropped),
        }


class LeaderThread(MLXThread):
    """The MLX thread of rank 0: between calls it sends heartbeats, and
    ``close`` tells the followers to stop without waiting forever on a
    group that may be gone."""

    backend: LeaderBackend | None = None

    def _serve(self) -> None:
        name_os_thread(self._thread.name)
        if self._init is not None:
            self._init()
        while True:
            try:
                job = self._jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                if self.backend is not None:
                    self.backend.beat()
                continue
            if job is None:
                return
            fn, args, done = job
            try:
                value, ok = fn(*args), True
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                value, ok = exc, False
            done(ok, value)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        backend = self.backend
        if backend is not None and backend.lost is None:
            try:
                self.submit(backend.link.stop).result(timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a stuck or lost group: exit anyway
                log.warning("[distributed] could not stop the followers: %r", exc)
        self._closed = True
        self._jobs.put(None)
        # A thread blocked in a collective never returns; it is a daemon thread.
        self._thread.join(timeout=timeout_s)


def load_distributed_backend(config: EngineConfig) -> tuple[LeaderBackend, LeaderThread]:
    device = LeaderThread()
    try:
        inner = device.call(load_sharded, config)
    except BaseException:
        device.close()
        raise
    backend = LeaderBackend(inner, RankLink(group()))
    device.backend = backend
    watch_parent()
    return backend, device


PARENT_POLL_S = 1.0


def watch_parent(poll_s: float = PARENT_POLL_S) -> None:
    """Stop rank 0 gracefully (SIGTERM to itself: drain, then the followers
    are told to stop) when the process that started it goes away.

    ``mlx.launch`` execs each rank as its child and forwards no SIGTERM (mlx
    0.32): a SIGTERM to the launcher killed it and left both ranks serving.
    A rank whose parent died is re-parented, so a changed ``getppid`` means the
    launcher is gone. Polled, not ``PR_SET_PDEATHSIG``: that is Linux only."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("[distributed] the launcher (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------
# Ranks 1..N-1.


class _NoTier:
    """A follower without an SSD tier: says no to every op (each asks one agreement)."""

    def __init__(self, link: RankLink):
        self.link = link

    def handle(self, data: bytes, stored: dict[int, Any]) -> None:
        self.link.agree(False)


def run_follower(config: EngineConfig, make_tier: Callable[[EngineConfig, Any, RankLink], Any] | None = None) -> int:
    """Load this rank's shard and execute rank 0's step plans until it says stop.

    ``make_tier(config, backend, link)``: this rank's side of the SSD tier
    (``actors.distributed_tier.follower_tier``, handed in from above the
    engine layer); without it every tier op rank 0 sends fails here, which
    makes it fail on every rank.

    Exit status: 0 on rank 0's stop; 1 when the group fails (a rank was
    lost); 3 when rank 0 went silent for ``FOLLOWER_SILENCE_S``."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    # Ctrl-C reaches every rank of the launch; rank 0 drains and then stops
    # the followers, so a follower waits for that instead of dying mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    grp = group()
    me = grp.rank()
    backend = load_sharded(config)
    link = RankLink(grp)
    tier = make_tier(config, backend, link) if make_tier is not None else _NoTier(link)
    log.info("[distributed] rank %d/%d following (%s)", me, grp.size(), config.distributed)
    waiting_since: list[float | None] = [time.monotonic()]  # None while a step runs (it may be long)

    def watchdog() -> None:
        while True:
            time.sleep(1.0)
            since = waiting_since[0]
            if since is not None and time.monotonic() - since > FOLLOWER_SILENCE_S:
                log.error("[distributed] rank %d: no word from rank 0 for %.0f s, exiting", me, FOLLOWER_SILENCE_S)
                os._exit(3)

    threading.Thread(target=watchdog, name="ember-follower-watchdog", daemon=True).start()
    from engine.mlx.cache_views import CachePrefix

    steps = 0
    stored: dict[int, list[Any]] = {}  # this rank's shard of every closed cache rank 0 holds, by name
    try:
        while True:
            waiting_since[0] = time.monotonic()
            kind, data = link.recv()
            if kind == _STOP:
                log.info("[distributed] rank %d: stop after %d steps (%d caches held)", me, steps, len(stored))
                return 0
            if kind == _BEAT:
                continue
            waiting_since[0] = None
            if kind == _TIER:
                with mx.stream(generation_stream):
                    tier.handle(data, stored)
                continue
            plan, drops = _decode_wire(data)
            for name in drops:
                stored.pop(name, None)
            for o in plan.open:
                if o.cache is None:
                    continue
                # a KeyError ends this rank: never a step on the wrong cache
                if o.cache < 0:  # an SSD restore: rank 0 opens the row on the restored cache itself
                    o.cache = stored.pop(o.cache)
                else:
                    o.cache = CachePrefix(stored[o.cache], o.cached)
            with mx.stream(generation_stream):
                try:
                    res = backend.step(plan)
                except MemoryError as exc:
                    # rank 0's Scheduler fails the same step's rows and goes on
                    log.warning("[distributed] rank %d: step failed: %r", me, exc)
                else:
                    stored.update(res.closed)
                    for rid, name in checkpoint_names(steps + 1, plan.checkpoint).items():
                        if rid in res.checkpoints:
                            stored[name] = res.checkpoints[rid]
            steps += 1
    except RuntimeError as exc:
        log.error("[distributed] rank %d: the group failed: %s", me, exc)
        return 1
