"""Many models behind one server: the names it can serve, each loaded on
demand as its own engine from the one assembler, unloaded when idle
(keep-alive) or least-recently-used first under a memory budget.

    reg = Registry(base_config, default="tiny", keep_alive_s=600, max_memory=8 << 30)
    async with anyio.create_task_group() as tg:
        await tg.start(reg.run)
        engine = await reg.engine_for("tiny-draft")   # loads it, waits, returns it

Names: the bundled and packaged short names, every mlx-lm directory, GGUF file and
sentence-transformers directory under ``models_dir``, ``--model`` itself, and
the embedding short names (``all-minilm-l6-v2``); aliases (``--alias NAME=MODEL``,
glob patterns allowed) map a client's fixed names onto them. Memory is measured
once loaded (the weights' array bytes, a draft model's included, KV and RAM-tier
bytes from the engine's stats); before a load, the weights' size on disk (the
drafter's added) stands in for it.

The SSD tier: each chat model has its own folder (``ember/ssd_folders.py``)
and all of them share the one byte cap of ``--ssd-cache-max``
(``engine.kv.budget.SsdBudget``, handed to every engine as ``Ports.ssd_budget``):
a write of one model may evict another's least recently used entries, and the
files earlier runs left in the folders of models not loaded yet count too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from actors.durability import FlushReport
from ember.api import Engine
from ember.assemble import load_ports
from ember.embed import EmbeddingEngine
from ember.model_state import ModelEvent, ModelState, next_state
from ember.served import Served
from ember.ssd_folders import model_ssd_dir
from ember.ssd_tier import ssd_on
from engine.adapters import AdapterSpec
from engine.config import EngineConfig
from engine.kv.budget import SsdBudget, scan_offline
from engine.ports import Ports, run_in_thread, run_inline
from engine.speculation import model_free

log = logging.getLogger("ember.registry")

GIB = 1 << 30

DEFAULT_KEEP_ALIVE_S = 600.0
LOAD_TIMEOUT_S = 300.0
MAX_LOAD_WAITERS = 256


def parse_keep_alive(value: float | str | None) -> float | None | str:
    """Ollama's ``keep_alive``: seconds, or a duration ("30s", "5m", "1h"); negative: forever (None);
    absent (None): "" (leave the model's keep-alive as it is). ValueError when it is neither."""
    if value is None:
        return ""
    if isinstance(value, str):
        v = value.strip()
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
        unit = next((u for u in ("ms", "s", "m", "h") if v.endswith(u)), "")
        try:
            seconds = float(v[: len(v) - len(unit)]) * scale.get(unit, 1.0)
        except ValueError:
            raise ValueError(f"keep_alive must be seconds or a duration like '5m', not {value!r}") from None
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number")
    return None if seconds < 0 else seconds


class ModelNotFound(LookupError):
    def __init__(self, name: str, names: list[str], why: str | None = None):
        super().__init__(why or f"the model {name!r} does not exist; this server serves: {', '.join(names)}")
        self.name, self.names = name, names


class ModelLoadFailed(RuntimeError):
    pass


class ModelLoadTimeout(RuntimeError):
    pass


class ModelBusy(RuntimeError):
    """Too many requests wait for one model's load, or the memory budget cannot fit it."""


@dataclass
class ModelEntry:
    name: str
    kind: str  # "chat" or "embed"
    source: str  # "--model", "bundled", "packaged", "models-dir", "embedding", "fake"
    target: str  # what EngineConfig.model (or the encoder) is given
    config: EngineConfig | None = None  # chat models
    ports: Callable[[], Ports] | None = None  # ports to hand Engine.open (tests: a fake backend of a stated size)
    size_bytes: int | None = None  # weights on disk, the estimate before a load
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S  # None: forever
    pinned: bool = False
    # runtime
    state: ModelState = ModelState.AVAILABLE  # ember.model_state: changed only by fire()
    engine: Any = None
    last_used: float = 0.0
    loaded_at: float | None = None
    load_s: float | None = None
    memory: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    loads: int = 0
    # what the flush of its last unload found (the drain runs it); None: loaded since, unloading,
    # or the drain missed its deadline (not durable)
    unload_flush: FlushReport | None = None
    _ready: anyio.Event | None = None
    _stop: anyio.Event | None = None
    _stopped: anyio.Event | None = None
    waiters: int = 0

    def fire(self, event: ModelEvent) -> None:
        """The one place a model's state changes (ember.model_state.TRANSITIONS)."""
        self.state = next_state(self.state, event)

    def context_length(self) -> int | None:
        if self.engine is not None:
            return getattr(self.engine, "context_length", None) or self.engine.info.context_length
        if self.config is not None and self.config.backend == "fake":
            return self.config.fake.context_length
        return None

    def card(self) -> dict[str, Any]:
        used = dict(self.memory)
        return {
            "id": self.name,
            "kind": self.kind,
            "state": self.state,
            "source": self.source,
            "path": self.target,
            "context_length": self.context_length(),
            "size_bytes": self.size_bytes,
            "memory_bytes": sum(used.values()) if used else None,
            "memory": used or None,
            "pinned": self.pinned,
            "keep_alive_s": self.keep_alive_s,
            "loads": self.loads,
            "load_s": self.load_s,
            "error": self.error,
        }


def _dir_size(path: pathlib.Path) -> int | None:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.glob("*.safetensors")) or None
    except OSError:
        return None


def _disk_size(target: str) -> int | None:
    """A bundled model's, a drafter's, a directory's or a downloaded hub model's
    weights on disk; None when unknown (a packaged GGUF before its conversion,
    a hub model before its pull)."""
    with contextlib.suppress(Exception):
        from engine.models import BUNDLED, DRAFTERS

        path = BUNDLED.get(target) or DRAFTERS.get(target) or pathlib.Path(target).expanduser()
        if not path.exists():  # a hub name: its size where it already is (none before a pull)
            from engine.models import hub

            ref = hub.parse(target)
            path = (hub.local_path(ref) if ref is not None else None) or path
        return _dir_size(path)
    return None


def discover(models_dir: str | None) -> list[tuple[str, str, str]]:
    """(name, kind, path) for every model under ``models_dir``: mlx-lm
    directories (config.json + safetensors), sentence-transformers
    directories (modules.json) and .gguf files, named by their file name."""
    if not models_dir:
        return []
    root = pathlib.Path(models_dir).expanduser()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".gguf":
            out.append((p.stem, "chat", str(p)))
        elif p.is_dir() and (p / "modules.json").is_file():
            out.append((p.name, "embed", str(p)))
        elif p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
            out.append((p.name, "chat", str(p)))
    return out


class Registry:
    def __init__(
        self,
        base: EngineConfig,
        *,
        default: str | None,
        ports: Ports | None = None,
        models_dir: str | None = None,
        keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S,
        max_memory: int | None = None,
        pins: tuple[str, ...] = (),
        aliases: dict[str, str] | None = None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        max_load_waiters: int = MAX_LOAD_WAITERS,
        short_names: bool = True,
        allow_pulls: tuple[str, ...] = (),
    ):
        self.base = base
        self.base_ports = ports or Ports()
        if ssd_on(base) and self.base_ports.ssd_budget is None:
            budget = SsdBudget(int(base.ssd_cache_max_gib * GIB))
            self.base_ports = dataclasses.replace(self.base_ports, ssd_budget=budget)
        self.ssd_budget = self.base_ports.ssd_budget
        self.keep_alive_s = keep_alive_s
        self.max_memory = max_memory
        self.load_timeout_s = load_timeout_s
        self.max_load_waiters = max_load_waiters
        self.aliases = dict(aliases or {})
        # hub names (ORG/NAME) a request may download: glob patterns, "*" for any (--allow-pulls)
        self.allow_pulls = tuple(allow_pulls)
        self.entries: dict[str, ModelEntry] = {}
        self.default = default
        self._tg: Any = None
        self._changed: anyio.Event | None = None
        self.evictions = {"keep_alive": 0, "memory": 0, "admin": 0}
        if default is not None:
            self.add(self._entry(default, "--model", base, keep_alive_s=None))
            if base.model_name and base.model_name != default:
                self.aliases.setdefault(base.model_name, default)
            if base.backend == "mlx" and base.model != default:
                self.aliases.setdefault(base.model, default)
        if base.backend == "mlx" and short_names:
            self._add_known(models_dir)
        for name in pins:
            self.resolve(name).pinned = True

    # ---- names -----------------------------------------------------------
    def _entry(self, name: str, source: str, config: EngineConfig, **kw: Any) -> ModelEntry:
        target = config.model
        size = None
        if config.backend == "mlx":
            size = _disk_size(target)
            if size is not None and config.draft_model and not model_free(config.draft_model):
                # the drafter loads inside this model's engine: it is this entry's memory too
                size += _disk_size(config.draft_model) or 0
        kw.setdefault("size_bytes", size)
        return ModelEntry(name=name, kind="chat", source=source, target=target, config=config, **kw)

    def add(self, entry: ModelEntry) -> ModelEntry:
        self.entries.setdefault(entry.name, entry)
        return self.entries[entry.name]

    def add_chat(self, name: str, config: EngineConfig, **kw: Any) -> ModelEntry:
        kw.setdefault("keep_alive_s", self.keep_alive_s)
        if config.ssd_cache_dir and config.ssd_cache_dir == self.base.ssd_cache_dir:
            # its own folder beside --model's (ember/ssd_folders.py), under the one cap
            config = msgspec.structs.replace(config, ssd_cache_dir=model_ssd_dir(self.base, config))
        return self.add(self._entry(name, kw.pop("source", "config"), config, **kw))

    def add_embedding(self, name: str, target: str, source: str = "embedding") -> ModelEntry:
        size = None
        with contextlib.suppress(Exception):
            from engine.mlx.embed import resolve_embedding_model

            size = _dir_size(resolve_embedding_model(target))
        return self.add(
            ModelEntry(
                name=name, kind="embed", source=source, target=target, size_bytes=size, keep_alive_s=self.keep_alive_s
            )
        )

    def _chat_config(self, target: str, name: str) -> EngineConfig:
        """A model beside --model: its settings, with prompt lookup and suffix
        decoding (which work with any model) but not --model's own draft model."""
        base_draft = self.base.draft_model if model_free(self.base.draft_model) else None
        base_gamma = self.base.num_draft_tokens if base_draft else None  # (needs a drafter)
        return msgspec.structs.replace(  # --adapter's adapters are --model's own
            self.base, model=target, model_name=name, draft_model=base_draft, num_draft_tokens=base_gamma, adapters=()
        )

    def _add_known(self, models_dir: str | None) -> None:
        from engine.mlx.embed import SHORT_NAMES
        from engine.mlx.gguf_models import PACKAGED, installed
        from engine.models import BUNDLED

        chat_config = self._chat_config
        for name in BUNDLED:
            if name != self.base.model:  # --model under its served name is the default entry (aliased above)
                self.add_chat(name, chat_config(name, name), source="bundled")
        for name in PACKAGED:
            if installed(name) and name != self.base.model:
                self.add_chat(name, chat_config(name, name), source="packaged")
        import importlib.util

        for name, pkg in SHORT_NAMES.items():
            if importlib.util.find_spec(pkg) is not None:
                self.add_embedding(name, name)
        for name, kind, path in discover(models_dir):
            if kind == "embed":
                self.add_embedding(name, path, source="models-dir")
            else:
                self.add_chat(name, chat_config(path, name), source="models-dir")

    def names(self) -> list[str]:
        return sorted(self.entries) + sorted(self.aliases)

    def adapter_for(self, name: str | None) -> AdapterSpec | None:
        """The LoRA adapter (``--adapter``) a request's model names, ``NAME`` or
        ``BASE:NAME`` (BASE the default model's name or an exact alias of it);
        None: no adapter. An adapter's name shadows a model of the same name."""
        if not name or self.default is None:
            return None
        by_name = {a.name: a for a in self.base.adapters}  # the default entry's config is base
        if name in by_name:
            return by_name[name]
        base, sep, short = name.rpartition(":")
        if sep and short in by_name and self.default in (base, self.aliases.get(base)):
            return by_name[short]  # (no resolve: a hub name must not become an entry here)
        return None

    def resolve(self, name: str | None) -> ModelEntry:
        """The entry a request's model names: the default for None, an entry's
        name, an alias (exact, then the first glob that matches), or a path
        ``models_dir`` did not list (a directory given by path is served as-is).
        A LoRA adapter's name (``adapter_for``) is the default model's entry."""
        if self.adapter_for(name) is not None:
            assert self.default is not None
            return self.entries[self.default]
        if name is None:
            if self.default is None:
                raise ModelNotFound("(none)", self.names())
            return self.entries[self.default]
        if name in self.entries:
            return self.entries[name]
        target = self.aliases.get(name)
        if target is None:
            target = next((t for pat, t in self.aliases.items() if fnmatch.fnmatchcase(name, pat)), None)
        if target is not None and target in self.entries:
            return self.entries[target]
        hub_entry = self._hub_entry(name)
        if hub_entry is not None:
            return hub_entry
        raise ModelNotFound(name, self.names())

    def _hub_entry(self, name: str) -> ModelEntry | None:
        """A Hugging Face name (ORG/NAME[:QUANT]) becomes an entry when the model is on
        this machine already (hub cache, LM Studio), or when ``allow_pulls`` lets a
        request download it: the load (``_open``, on a worker thread) pulls it, and
        other models keep serving meanwhile. A request never downloads unasked: an
        uncached name without the flag is ModelNotFound (the routes' 404)."""
        if self.base.backend != "mlx" or os.path.exists(os.path.expanduser(name)):
            return None
        from engine.models import hub

        ref = hub.parse(name)
        if ref is None:
            return None
        if hub.local_path(ref) is None and not any(fnmatch.fnmatchcase(ref.repo_id, p) for p in self.allow_pulls):
            raise ModelNotFound(
                name,
                self.names(),
                f"the model {name!r} is not downloaded on this server; `ember pull {name}` fetches it, "
                "or start the server with --allow-pulls to let requests download hub models",
            )
        return self.add_chat(name, self._chat_config(name, name), source="hub")

    # ---- running ---------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The registry's task group (every loaded model's engine runs in it)
        and the keep-alive reaper. Cancel it to stop: every model unloads."""
        self._changed = anyio.Event()
        await self._count_offline_ssd()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._reaper)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None

    async def _count_offline_ssd(self) -> None:
        """The shared SSD cap counts the files earlier runs left in the folders
        of the models this server can load (not loaded yet, so no store indexes
        them): a header-free listing, off the loop."""
        if self.ssd_budget is None:
            return
        dirs = sorted(
            {e.config.ssd_cache_dir for e in self.entries.values() if e.config is not None and e.config.ssd_cache_dir}
        )
        disk = self.base_ports.disk
        if disk is None:
            from engine.kv.disk import RealDisk

            disk = RealDisk()
        io = self.base_ports.io or (run_inline if self.base.backend in ("fake", "scripted") else run_in_thread)
        try:
            files = await io(scan_offline, disk, [os.path.abspath(os.path.expanduser(d)) for d in dirs])
        except Exception as exc:  # noqa: BLE001 - a folder it cannot list holds nothing it could count
            log.warning("[registry] cannot list the SSD folders: %r", exc)
            return
        self.ssd_budget.add_offline(files)
        log.info("[registry] ssd cap=%d files_from_earlier_runs=%d", self.ssd_budget.max_bytes, len(files))

    async def shutdown(self) -> None:
        """Unload every model (each drains and flushes)."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for e in list(self.entries.values()):
                    if e.state in ("loaded", "loading", "unloading"):
                        tg.start_soon(functools.partial(self.unload, e.name, reason=None))

    def _now(self) -> float:
        return anyio.current_time()

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def engine_for(self, name: str | None, *, keep_alive_s: float | None | str = "") -> Any:
        """The loaded engine for ``name``, loading it first if need be (one
        load per model; the others wait, at most ``load_timeout_s``).
        ``keep_alive_s``: a request's own keep-alive for its model (Ollama's
        ``keep_alive``; None: forever); "" leaves it as it is."""
        entry = self.resolve(name)
        entry.last_used = self._now()
        if keep_alive_s != "":
            entry.keep_alive_s = keep_alive_s  # type: ignore[assignment]
            self._poke()
        while True:
            if entry.state == "loaded" and entry.engine is not None:
                entry.last_used = self._now()
                return entry.engine  # ready, or dead: the caller answers for its status
            if entry.state == "unloading" and entry._stopped is not None:
                await entry._stopped.wait()
                continue
            if entry.state == "available":
                await self._start_load(entry)
            if entry.waiters >= self.max_load_waiters:
                raise ModelBusy(f"{entry.waiters} requests already wait for {entry.name!r} to load; try again")
            entry.waiters += 1
            try:
                assert entry._ready is not None
                with anyio.move_on_after(self.load_timeout_s) as scope:
                    await entry._ready.wait()
            finally:
                entry.waiters -= 1
            if scope.cancelled_caught:
                raise ModelLoadTimeout(
                    f"the model {entry.name!r} did not finish loading within {self.load_timeout_s:g} s; try again"
                )
            if entry.state == "available" and entry.error is not None:
                if entry.source == "hub" and not entry.loads:  # a failed pull: forget the name, as if never asked
                    self.entries.pop(entry.name, None)
                raise ModelLoadFailed(f"the model {entry.name!r} failed to load: {entry.error}")

    async def load(self, name: str) -> ModelEntry:
        await self.engine_for(name)
        return self.resolve(name)

    async def _start_load(self, entry: ModelEntry) -> None:
        assert self._tg is not None, "Registry.run is not running"
        await self._make_room(entry)
        entry.fire(ModelEvent.LOAD)
        entry.error = None
        entry._ready, entry._stop, entry._stopped = anyio.Event(), anyio.Event(), anyio.Event()
        self._tg.start_soon(self._hold, entry)

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload least-recently-used models until the new one's estimate fits ``max_memory``."""
        if self.max_memory is None:
            return
        need = entry.size_bytes or 0
        while True:
            held = [e for e in self.entries.values() if e.state in ("loaded", "loading") and e is not entry]
            used = sum(sum(e.memory.values()) or (e.size_bytes or 0) for e in held)
            if used + need <= self.max_memory:
                return
            victims = sorted((e for e in held if e.state == "loaded" and not e.pinned), key=lambda e: e.last_used)
            if not victims:
                raise ModelBusy(
                    f"loading {entry.name!r} (~{need} bytes) would exceed the memory budget of {self.max_memory} "
                    f"bytes ({used} in use by {', '.join(e.name for e in held)}, none of it unloadable)"
                )
            log.info("[registry] evicting %s (least recently used) to load %s", victims[0].name, entry.name)
            self.evictions["memory"] += 1
            await self.unload(victims[0].name, reason=None)

    async def _hold(self, entry: ModelEntry) -> None:
        """Open the model's engine, keep it open until told to unload, then close it (drain, flush)."""
        assert entry._ready is not None and entry._stop is not None and entry._stopped is not None
        t0 = time.perf_counter()
        try:
            async with self._open(entry) as engine:
                entry.engine = engine
                entry.unload_flush = None  # requests run on it from here: an earlier unload's flush is stale
                entry.fire(ModelEvent.OPENED)
                entry.loads += 1
                entry.load_s = time.perf_counter() - t0
                entry.loaded_at = entry.last_used = self._now()
                entry.memory = measure(engine)
                entry._ready.set()
                self._poke()
                log.info("[registry] loaded %s in %.2fs memory=%s", entry.name, entry.load_s, entry.memory)
                await entry._stop.wait()
                entry.fire(ModelEvent.STOP)
                drained = await engine.drain()  # running requests finish, write-behind flushes
                # no SSD tier: no flush ran, and an empty report is durable (as Engine.aflush answers)
                flush = getattr(engine, "last_flush", None) or FlushReport(durable=True)
                entry.unload_flush = flush if drained else None
        except Exception as exc:  # noqa: BLE001 - a failed load is the requests' 5xx, not the server's death
            entry.error = f"{type(exc).__name__}: {exc}"
            log.error("[registry] %s failed: %s", entry.name, entry.error)
        finally:
            entry.engine = None
            entry.memory = {}
            entry.fire(ModelEvent.CLOSED)
            entry._ready.set()
            entry._stopped.set()
            self._poke()

    @contextlib.asynccontextmanager
    async def _open(self, entry: ModelEntry) -> Any:
        if entry.kind == "embed":
            async with EmbeddingEngine.open(entry.target) as emb:
                yield emb
            return
        assert entry.config is not None
        config = entry.config.validate()
        if entry.ports is not None:
            base = entry.ports()
            if base.ssd_budget is None:
                base = dataclasses.replace(base, ssd_budget=self.ssd_budget)
        elif entry.name == self.default:
            base = dataclasses.replace(self.base_ports)
        else:  # its own backend, device and event log, from its config; the clock and disk are shared
            base = dataclasses.replace(self.base_ports, backend=None, device=None, events=None, observer=None)
        load = functools.partial(load_ports, config, base, keep_events=False)
        if base.backend is None and config.backend != "fake":
            ports = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
        else:
            ports = load()
        async with Engine.open(config, ports=ports) as engine:
            yield engine

    async def unload(self, name: str, *, reason: str | None = "admin") -> bool:
        """Unload now: waits for its running requests, flushes, frees. False if it was not loaded."""
        entry = self.resolve(name)
        if entry.state == "loading" and entry._ready is not None:
            await entry._ready.wait()
        if entry.state not in ("loaded", "unloading") or entry._stop is None or entry._stopped is None:
            return False
        if reason is not None:
            self.evictions[reason] = self.evictions.get(reason, 0) + 1
        entry._stop.set()
        await entry._stopped.wait()
        _release_memory()
        return True

    def last_flush(self, name: str) -> FlushReport:
        """What an unloaded model's cache flush found: the one its unload ran, since
        nothing has run on it after. Not durable when that drain missed its deadline."""
        return self.resolve(name).unload_flush or FlushReport(durable=False)

    async def _reaper(self) -> None:
        """Unload models idle longer than their keep-alive (none for --model by default, or pinned)."""
        while True:
            now = self._now()
            wake = None
            for e in list(self.entries.values()):
                if e.state != "loaded" or e.pinned or e.keep_alive_s is None or e.engine is None:
                    continue
                if busy(e.engine):
                    e.last_used = now
                deadline = e.last_used + max(0.0, e.keep_alive_s)
                if deadline <= now:
                    log.info(
                        "[registry] unloading %s: idle %.0fs (keep-alive %ss)",
                        e.name,
                        now - e.last_used,
                        e.keep_alive_s,
                    )
                    self.evictions["keep_alive"] += 1
                    self._tg.start_soon(functools.partial(self.unload, e.name, reason=None))
                    continue
                wake = deadline if wake is None else min(wake, deadline)
            assert self._changed is not None
            changed = self._changed
            delay = math.inf if wake is None else max(0.0, wake - now)
            with anyio.move_on_after(delay):
                await changed.wait()

    # ---- reports ---------------------------------------------------------
    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state == "loaded" and e.engine is not None]

    def refresh_memory(self) -> None:
        for e in self.loaded():
            e.memory = measure(e.engine)

    def stats(self) -> dict[str, Any]:
        self.refresh_memory()
        return {
            "max_memory_bytes": self.max_memory,
            "memory_bytes": sum(sum(e.memory.values()) for e in self.loaded()),
            "evictions": dict(self.evictions),
            **({"ssd": self.ssd_budget.stats()} if self.ssd_budget is not None else {}),
            "process": process_memory(),
            "aliases": dict(self.aliases),
            "models": {
                name: {**e.card(), **({"stats": e.engine.stats()} if e.engine is not None else {})}
                for name, e in self.entries.items()
                if e.state != "available" or e.loads
            },
        }


def busy(engine: Served) -> bool:
    try:
        return engine.in_flight() > 0
    except Exception:  # noqa: BLE001 - a dead engine is not busy
        return False


def measure(engine: Any) -> dict[str, int]:
    """What a loaded model holds, measured: its weights' array bytes (its draft
    model's too), and its KV and RAM-tier bytes from the engine's stats."""
    if isinstance(engine, EmbeddingEngine):
        return engine.memory()
    out = {"weights_bytes": weight_bytes(engine.backend)}
    draft = draft_weight_bytes(engine)
    if draft:
        out["draft_weights_bytes"] = draft
    st = engine.stats()
    out["ram_tier_bytes"] = int((st.get("prompt_cache") or {}).get("bytes", 0) or 0)
    sched = st.get("scheduler") or {}
    out["kv_bytes"] = int(sched.get("kv_bytes", 0) or 0)
    return out


def draft_weight_bytes(engine: Any) -> int:
    """The draft model's weights (``--draft-model``): it loads inside the target's
    engine (``ember.spec_build``), beside ``engine.backend``, so the backend's
    parameters alone leave it out of the budget. 0 for prompt lookup and suffix
    decoding, which hold no model."""
    spec = getattr(engine, "speculation", None)
    core = getattr(getattr(spec, "drafter", None), "core", None)
    model = getattr(core, "model", None)  # ModelDrafterCore's DraftModel
    return weight_bytes(model) if model is not None else 0


def weight_bytes(backend: Any) -> int:
    """The weights' bytes: the MLX model's parameter arrays, or what a fake backend states."""
    stated = getattr(backend, "weight_bytes", None)
    if isinstance(stated, int):
        return stated
    model = getattr(backend, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return 0
    from mlx.utils import tree_flatten

    leaves: list[Any] = list(tree_flatten(model.parameters()))
    return int(sum(pair[1].nbytes for pair in leaves))


def process_memory() -> dict[str, int | None]:
    """What the whole process holds, measured: resident set size (Linux
    ``/proc/self/statm``; None elsewhere) and MLX's active and cached buffer
    bytes (None until MLX is imported). An unload is checked against these."""
    import sys

    rss = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    mx = sys.modules.get("mlx.core")
    active = cache = None
    if mx is not None:
        with contextlib.suppress(Exception):
            active, cache = int(mx.get_active_memory()), int(mx.get_cache_memory())
    return {"rss_bytes": rss, "mlx_active_bytes": active, "mlx_cache_bytes": cache}


def _release_memory() -> None:
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        mx = sys.modules.get("mlx.core")
        if mx is not None:
            mx.clear_cache()
    _trim_heap()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``).
    MLX's CPU buffers come from malloc; after a free, glibc raises its mmap
    threshold, so the next large buffers sit in the heap and an unload that
    frees every one of them left RSS where it was (measured in CI's long-lived
    pytest process: MLX active memory fell by the weights, RSS by 113 MB of 538)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
