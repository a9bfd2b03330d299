"""The simulated world around the engine: virtual time, the recording disk,
and the host that starts, kills and restarts engines.

``SimLoop`` is the event loop (virtual time, deadlock detection); the
``RecordingDisk`` puts every disk mutation in the event log; ``Host`` runs
one engine at a time for a ``sims.run.Simulation`` (as ``Hosted``).
"""

from __future__ import annotations

import asyncio.base_events
import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import async_solipsism

from ember import Engine, EngineConfig, Ports
from engine.errors import EngineDead
from engine.eventlog import EventLog


def derive(seed: int, label: str) -> int:
    """An independent seed for one part of the run (trace, GPU faults, disk…)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{label}".encode(), digest_size=8).digest(), "little")


class _ExactClock:
    """Virtual time as a plain float that lands exactly on each timer.

    async_solipsism counts whole microseconds and rounds each advance, so
    ``ticks * 1e-6`` can sit a hair below an anyio deadline (say 48.2916):
    anyio's ``CancelScope`` then re-arms its timer for the same instant
    forever, and the loop spins without time moving (a ResolutionWarning).
    Advancing by exactly the loop's timeout reaches ``when`` itself."""

    resolution = 1e-9

    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        return self.t

    def advance(self, delta: float) -> None:
        self.t += delta


class SimLoop(async_solipsism.EventLoop):
    """``async_solipsism.EventLoop`` (virtual time, deadlock detection) on ``_ExactClock``."""

    def __init__(self) -> None:
        super().__init__()
        self._sim_clock = _ExactClock()
        self._selector.clock = self._sim_clock
        self._clock_resolution = _ExactClock.resolution
        self._selector.select = _fast_select(self._selector)

    def time(self) -> float:
        return self._sim_clock.t


def _fast_select(sel: Any) -> Any:
    """``sel.select`` (async_solipsism's ``Selector``), with no walk over the
    registered sockets while there are none, which is always here: the
    engine opens no sockets in a simulation. The loop selects once per turn
    (~300,000 times in chat-10k); with nothing registered the general select
    finds nothing ready and does exactly this: raise if it would sleep
    forever, else advance the clock by the timeout."""
    general = sel.select
    fds = sel._fd_to_key  # selectors' fd -> key map: registering fills it
    clock = sel.clock
    max_timeout = asyncio.base_events.MAXIMUM_SELECT_TIMEOUT  # type: ignore[attr-defined]  # private, not in typeshed

    def select(timeout: float | None = None) -> list[Any]:
        if fds or sel._closed:
            return general(timeout)  # sockets to poll, or closed (it raises)
        if timeout is None or timeout >= max_timeout:
            raise async_solipsism.SleepForeverError("select with no timeout and no ready events")
        if timeout > 0:
            clock.advance(timeout)
        return []

    return select


class PowerLoss(EngineDead):
    """The simulator pulled the plug (the engine gets no drain and no flush)."""


# ---------------------------------------------------------------------------
# The disk the SSD tier sees: the FaultyDisk, with every write in the event log.


class RecordingDisk:
    """Delegates to ``engine.fake.disk.FaultyDisk`` and records each mutation, so
    checkers see disk writes in the same order as GPU steps.

    Consecutive mutations with no other record between them are one ``disk``
    record (``ops``: each call as ``[op, path, ...]`` in order, ``t``: the
    first call's time), held open in the event log until the next record of
    any kind: a checker sees the same state for every call in the run, as it
    would one record at a time, for one record instead of ~9 per entry."""

    def __init__(self, inner: Any, events: EventLog, clock: Any):
        self.inner = inner
        self.events = events
        self.clock = clock
        self.paths: dict[int, str] = {}
        self._ops: list[list[Any]] = []
        self._t = 0.0
        self._flush_cb = self._flush  # one bound method: the log's ``holding`` is compared by identity

    def _rec(self, *op: Any) -> None:
        events = self.events
        if events.holding is not self._flush_cb:
            events.settle()
            self._t = self.clock.now()
            events.hold(self._flush_cb)
        self._ops.append(list(op))

    def _flush(self) -> None:
        ops, self._ops = self._ops, []
        self.events.record("disk", self._t, ops=ops)

    def open(self, path: str, *, write: bool = False) -> int:
        fh = self.inner.open(path, write=write)
        self.paths[fh] = path
        if write:
            self._rec("open", path)
        return fh

    def close(self, fh: int) -> None:
        self.paths.pop(fh, None)
        self.inner.close(fh)

    def write(self, fh: int, offset: int, data: Any) -> None:
        self._rec("write", self.paths.get(fh, "?"), offset, memoryview(data).nbytes)
        self.inner.write(fh, offset, data)

    def read(self, fh: int, offset: int, n: int) -> bytes:
        return self.inner.read(fh, offset, n)

    def fstat(self, fh: int) -> Any:
        return self.inner.fstat(fh)

    def fsync(self, fh: int) -> None:
        self._rec("fsync", self.paths.get(fh, "?"))
        self.inner.fsync(fh)

    def rename(self, src: str, dst: str) -> None:
        self._rec("rename", src, dst)
        self.inner.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._rec("fsync_dir", path)
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        self._rec("unlink", path)
        self.inner.unlink(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def stat(self, path: str) -> Any:
        return self.inner.stat(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def touch(self, path: str) -> None:
        self.inner.touch(path)


# ---------------------------------------------------------------------------
# One engine at a time: started, crashed, restarted.


@dataclass(frozen=True)
class _Cmd:
    kind: str  # "crash" (power loss), "graceful", "died" (the engine crashed itself), "stop"
    gen: int = 0
    down_s: float = 2.0


class Hosted(Protocol):
    """What a ``Host`` needs of the simulation it runs the engine for
    (``sims.run.Simulation``, which imports this module)."""

    config: EngineConfig

    def ports(self, gen: int) -> Ports: ...

    def record(self, kind: str, **f: Any) -> None: ...

    def after_up(self, engine: Engine) -> None: ...

    def went_down(self, engine: Engine) -> None: ...

    def power_loss(self) -> None: ...


class Host:
    """Runs the engine; restarts it when the trace says so, when the
    simulator pulls the plug, or when it died on its own (a hung GPU step)."""

    def __init__(self, sim: Hosted):
        self.sim = sim
        self.engine: Engine | None = None
        self.gen = 0
        self._up = anyio.Event()
        self._send, self._recv = anyio.create_memory_object_stream[_Cmd](64)
        self.restarts = {"graceful": 0, "crash": 0, "died": 0}
        self.last_engine: Engine | None = None

    async def current(self) -> tuple[Engine, int]:
        while self.engine is None:
            await self._up.wait()
        return self.engine, self.gen

    def command(self, cmd: _Cmd) -> None:
        self._send.send_nowait(cmd)

    def restart(self, crash: bool, down_s: float) -> None:
        """Restart the engine that is up now; a server that is already down
        (restarting) has no process to kill, so the command lapses."""
        if self.engine is not None:
            self.command(_Cmd("crash" if crash else "graceful", self.gen, down_s))

    def died(self, gen: int) -> None:
        if gen == self.gen and self.engine is not None:
            self.command(_Cmd("died", gen))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        sim = self.sim
        started = False
        while True:
            self.gen += 1
            async with Engine.open(sim.config, ports=sim.ports(self.gen)) as engine:
                self.engine = engine
                sim.record("sim_up", gen=self.gen)
                sim.after_up(engine)
                self._up.set()
                if not started:
                    task_status.started()
                    started = True
                while True:
                    cmd = await self._recv.receive()
                    if cmd.kind == "stop" or cmd.gen == self.gen:
                        break  # restarts and deaths of an engine already gone lapse
                self.engine = None
                self._up = anyio.Event()
                if cmd.kind in self.restarts:
                    self.restarts[cmd.kind] += 1
                sim.record("sim_restart", gen=self.gen, how=cmd.kind)
                if cmd.kind == "crash":
                    sim.went_down(engine)  # what it held at the instant the power went
                    sim.power_loss()
                    engine.kill(PowerLoss("the simulator cut the power"))  # the process is gone: no drain, no flush
            if cmd.kind != "crash":
                sim.went_down(engine)  # after its drain, shutdown flush and stop
            sim.record("sim_down", gen=self.gen)
            self.last_engine = engine
            if cmd.kind == "stop":
                self._send.close()
                self._recv.close()
                return
            await anyio.sleep(cmd.down_s)
