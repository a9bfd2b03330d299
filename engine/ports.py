"""Ports: how the outside world (time, the GPU/model, the disk) reaches the actors.

Actors never call ``time.time()``, MLX or ``open()`` directly; they are handed
objects implementing these protocols. The MLX backend and the deterministic
fake GPU implement the same ``Backend``; ``Device`` says where backend calls
run (a dedicated MLX thread, or inline after a virtual-time sleep); the SSD
tier's files go through a ``Disk`` (engine.kv.disk) and its blocking calls
through an ``IoRunner``.

``Ports`` carries them all into ``ember.assemble``, the one place the engine
is built: a simulation or a benchmark swaps a port (a faulty disk, a slow I/O
runner, a phase observer) instead of patching an actor after construction.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import _get_running_loop
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.eventlog import EventLog
    from engine.kv.budget import SsdBudget
    from engine.kv.disk import Disk
    from engine.tool_markup import ReasoningMarkup, ToolMarkup
    from engine.types import Constraint

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """Time of the running event loop: wall time in production, virtual time
    under ``async_solipsism`` (tests, sims).

    On an asyncio loop it asks the loop directly: ``anyio.current_time`` and
    ``anyio.sleep`` look the async backend up on every call (sniffio, a
    dict), and the engine reads the clock several times per GPU step. They
    are what anyio's asyncio backend does itself (``loop.time()``,
    ``asyncio.sleep``); any other backend goes through anyio."""

    def now(self) -> float:
        loop = _get_running_loop()
        if loop is not None:
            return loop.time()
        return anyio.current_time()

    async def sleep(self, seconds: float) -> None:
        if _get_running_loop() is not None:
            await asyncio.sleep(seconds)
        else:
            await anyio.sleep(seconds)


class Tokenizer(Protocol):
    eos_token_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template's text as tokens (its special tokens read as such)."""
        ...

    def detokenizer(self) -> Detokenizer: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...

    @property
    def tool_markup(self) -> ToolMarkup | None:
        """How the chat template writes tool calls; None: it has no tools."""
        ...

    @property
    def reasoning_markup(self) -> ReasoningMarkup | None:
        """How the model marks its reasoning; None: it does not think."""
        ...


class Detokenizer(Protocol):
    """Streaming detokenizer: feed tokens, read the text that became final."""

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def last_segment(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str
    vocab_size: int
    context_length: int
    config_fingerprint: str
    tokenizer_hash: str
    num_layers: int
    # The backend applies SamplingParams' logits processing (constraint,
    # penalties, logit_bias, logprobs); the Gateway refuses them otherwise.
    logits_processing: bool = False
    # The backend enforces SamplingParams.constraint (a grammar) even without the
    # rest of logits processing (the scripted test model masks its script by it).
    constraints: bool = False


@dataclass(slots=True)
class OpenRow:
    """Start a row: its sampling settings and an optional prefix cache (already a
    private copy, trimmed to ``cached`` tokens) to continue from. ``prefix``: the
    ``cached`` prompt tokens that cache holds, so that a cache the backend cannot
    open (a fault) is a miss: the row opens empty and prefills them first
    (``StepResult.cache_faults``). ``adapter``: the LoRA adapter the row runs
    with (``NAME@HASH``, its namespace's adapter part; empty: the base model)."""

    rid: int
    sampling: SamplingParams
    cache: Any = None
    cached: int = 0
    prefix: list[int] = field(default_factory=list)
    adapter: str = ""


@dataclass(slots=True)
class PrefillChunk:
    """Feed ``tokens`` into the row's cache; no token is sampled."""

    rid: int
    tokens: list[int]


@dataclass(slots=True)
class DecodeRow:
    """Feed ``token`` and sample the next one."""

    rid: int
    token: int


@dataclass(slots=True)
class VerifyRow:
    """Feed the window ``[last, d1..dk]`` in one forward and return the target's
    token at each of the k+1 positions (argmax, or sampled with the row's sampler).
    A backend may stop the window at its first draft when the target's token
    after ``last`` is not ``d1`` (``StepResult.stopped``)."""

    rid: int
    tokens: list[int]


@dataclass(slots=True)
class StepPlan:
    """One batched GPU step, in application order: close, open, trim, prefill,
    decode and verify."""

    close: list[int] = field(default_factory=list)
    keep_cache: set[int] = field(default_factory=set)
    open: list[OpenRow] = field(default_factory=list)
    trim: list[tuple[int, int]] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    verify: list[VerifyRow] = field(default_factory=list)
    # rows whose cache, as it stands after this step's prefill (before any
    # decode), comes back in ``StepResult.checkpoints``: a prefix entry for
    # caches that cannot be trimmed back to it later (SSM state, a wrapped window)
    checkpoint: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.close or self.open or self.trim or self.prefill or self.decode or self.verify)

    @property
    def gpu_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.prefill) + len(self.decode) + sum(len(v.tokens) for v in self.verify)


@dataclass(slots=True)
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)
    verified: dict[int, list[int]] = field(default_factory=dict)
    closed: dict[int, Any] = field(default_factory=dict)  # rid -> cache (when kept)
    errors: dict[int, str] = field(default_factory=dict)  # rid -> per-row failure
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # rid -> its token's, when asked for
    checkpoints: dict[int, Any] = field(default_factory=dict)  # rid -> a private copy of its cache (plan.checkpoint)
    cache_faults: dict[int, str] = field(default_factory=dict)  # rid -> why its prefix cache could not open (a miss)
    # Verify rows whose window stopped at its first draft, which the target
    # rejected: only ``last`` was fed (``verified`` holds one token) and the
    # drafts cost no forward. The MLX backend does this where the window's
    # first position is a decode step it ran ahead (``RunAhead._verify_rest``).
    stopped: set[int] = field(default_factory=set)


class GrammarCompiler(Protocol):
    """A backend's grammars for constrained decoding (``engine.mlx.grammar.Grammars``)."""

    def compile(self, c: Constraint) -> Any:
        """Compile (or find cached) a constraint's grammar; raises ``InvalidRequest``
        for one that is invalid or unsupported. Safe on a worker thread."""
        ...

    def tokenizer(self) -> Any:
        """llguidance's tokenizer of the model (``decode_bytes``: a token's own bytes)."""
        ...


class Backend(Protocol):
    """The GPU/model port. Every method runs on the ``Device``, never on the loop.

    Its capabilities are read as attributes (properties here, so a backend may
    hold plain fields of narrower types); ``BackendDefaults`` gives a backend
    the values of one that has none of them."""

    info: ModelInfo

    @property  # read-only, so a backend may hold a more specific tokenizer
    def tokenizer(self) -> Tokenizer: ...

    @property
    def needs_checkpoints(self) -> bool:
        """Its caches may become impossible to trim back to a prompt's end (SSM
        state, a wrapped sliding window): the Scheduler asks for checkpoints
        (``StepPlan.checkpoint``)."""
        ...

    @property
    def can_checkpoint(self) -> bool:
        """It answers ``StepPlan.checkpoint`` for any row (a copy of the row's
        cache after the step's prefill): the Scheduler may then let a request
        wait for another row's prefill of the prefix they share instead of
        prefilling it again (``SchedulerConfig.shared_prefill_min``)."""
        ...

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Compiles ``SamplingParams.constraint``; None: no constrained decoding."""
        ...

    @property
    def fallbacks(self) -> dict[str, int] | None:
        """Paths a cache kind ruled out, and how often (/stats); None: it counts none."""
        ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def cache_nbytes(self, cache: Any) -> int: ...

    def prefix_view(self, cache: Any, n: int) -> Any: ...

    def trim_cache(self, cache: Any, n: int) -> int: ...

    def cache_trimmable(self, cache: Any) -> bool: ...

    def step_cost_s(self, plan: StepPlan) -> float:
        """Virtual-time cost of a step (the fake GPU's cost model); 0 for real hardware."""
        ...


class Device(Protocol):
    """Where backend calls run."""

    @property
    def exact_cost(self) -> bool:
        """A run takes exactly its ``cost_s`` of clock time (virtual time): a step
        whose cost ends before its deadline cannot hang (the step watchdog)."""
        ...

    async def run(self, fn: Callable[..., T], *args: Any, cost_s: float = 0.0) -> T: ...

    def close(self) -> None: ...


class BackendDefaults:
    """The capabilities of a backend that has none (the fake GPU): no checkpoints,
    no grammars, no fallbacks counted. A backend inherits it, or sets all four."""

    needs_checkpoints = False
    # the fake GPU copies a checkpoint when asked but says it cannot, so the
    # simulations keep their admission order; a test sets it on an instance
    can_checkpoint = False
    grammars: GrammarCompiler | None = None
    fallbacks: dict[str, int] | None = None


class InlineDevice:
    """Runs calls inline on the loop after sleeping their cost in (virtual) time.

    Used with the fake GPU: the sleep is the modelled GPU time, the call itself
    is cheap numpy work.
    """

    exact_cost = True
    """A run takes exactly ``cost_s`` of clock time: its sleep, then ``fn``
    inline (the Scheduler's step watchdog reads this: a step whose cost ends
    before its deadline cannot hang)."""

    def __init__(self, clock: Clock):
        self.clock = clock

    async def run(self, fn: Callable[..., T], *args: Any, cost_s: float = 0.0) -> T:
        if cost_s > 0:
            await self.clock.sleep(cost_s)
        return fn(*args)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------
# Where blocking file I/O runs.

IoRunner = Callable[..., Awaitable[Any]]


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Run file I/O inline (virtual-time tests and sims, where no thread may run)."""
    return fn(*args)


async def run_in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run file I/O on a worker thread, off the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


class PhaseObserver(Protocol):
    """Told how long each part of a Scheduler step took, in ``time.perf_counter``
    seconds: ``"draft"`` (the Drafter ask, draft-model forwards included),
    ``"step"`` (the device's GPU step) and ``"verify"`` (the Verifier ask). A
    benchmark's timing hook (bench/spec.py's round anatomy); an engine built
    without one times nothing."""

    def phase(self, name: str, start: float, seconds: float) -> None: ...


@dataclass(slots=True)
class Ports:
    """Everything outside the engine's own logic, handed to ``ember.assemble``.

    A port left None is chosen from the config by ``ember.assemble.load_ports``:
    the loop's clock, the backend named by ``config.backend`` and the device its
    calls run on, an event log, the real disk, and an I/O runner (inline beside
    an inline device, a worker thread otherwise)."""

    clock: Clock | None = None
    backend: Backend | None = None
    device: Device | None = None  # with ``backend`` given and no device: inline, on ``clock``
    events: EventLog | None = None
    disk: Disk | None = None  # the SSD tier's files
    io: IoRunner | None = None  # where the SSD tier's blocking file calls run
    wall: Callable[[], float] = time.time  # the time SSD file headers carry (a sim: its virtual clock)
    # False: the SSD writer's tensor steps do not wait for an idle engine
    # (bench/writebehind.py's "ungated" arm, and a sim test proving the gate matters)
    gated_writes: bool = True
    observer: PhaseObserver | None = None
    # one SSD byte cap across the engines that share this object (ember/registry.py:
    # every model a server holds); None: the engine's own ``ssd_cache_max_gib``
    ssd_budget: SsdBudget | None = None
