"""Invariant checkers: each watches the event log (``EventLog.listeners``) of a
simulation and reports findings; none of them changes what it watches.

(~510 lines on purpose: one module holds every checker, numbered as the
properties at the end of PROTOCOLS.md, so the checks read in the doc's order.)

The properties are the ones at the end of PROTOCOLS.md. A checker whose
component is absent from the engine (no SSD tier, no durability actor yet)
says so instead of passing silently: the summary lists which checkers ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.config import FakeGPUConfig
from engine.fake.logits import _advance, _initial_hash, advance_all, fake_logits, greedy_token
from engine.fake.sampling import sample_token
from engine.fake.tokenizer import ByteTokenizer
from engine.types import SamplingParams

if TYPE_CHECKING:
    from ember.api import Engine


@dataclass(frozen=True, slots=True)
class Finding:
    checker: str
    t: float
    message: str

    def __str__(self) -> str:
        return f"[{self.checker}] t={self.t:.3f}s: {self.message}"


class SimView(Protocol):
    """What checkers may look at in the running simulation."""

    @property
    def engine(self) -> Engine | None: ...

    @property
    def healed_at(self) -> float | None: ...


class Checker:
    """Base: ``on_event`` after every record, ``end`` once the run is over."""

    name = "checker"
    prop = ""  # the PROTOCOLS.md property it guards

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.checked = 0
        self.absent: str | None = None  # why it could not run, if it could not

    def on_event(self, kind: str, t: float, f: dict[str, Any]) -> None:
        pass

    def end(self, t: float) -> None:
        pass

    def fail(self, t: float, message: str) -> None:
        self.findings.append(Finding(self.name, t, message))

    @property
    def ran(self) -> bool:
        return self.absent is None

    def detail(self) -> str:
        return f"{self.checked} checked"


# ---------------------------------------------------------------------------
# 1. No disk write step during a GPU step.


class NoWriteDuringStep(Checker):
    """A GPU step is the span from ``step`` to ``step_end``; a tensor write step
    is the span ``write_start``..``write_end`` the write path records around
    each gated unit (its tensors and commit while the engine stays idle), and
    the disk calls inside it (``disk_write``/``disk_fsync``, or the write and
    fsync ops of a ``disk`` record from the simulator's disk proxy) belong to it.

    No write step may *begin* during a GPU step, and no disk write may happen
    during a GPU step outside a write step (an ungated write). A write step
    that began while the engine was idle may still be in flight when a request
    arrives: the GPU step starts at once instead of waiting for it (admission
    never waits on a write, property 2), and that one step's remaining I/O
    lands during the GPU step — the trade-off the reference design accepts
    ("one in-flight tensor step can still land ahead of a just-arrived
    request"). Those overlaps are counted, not failed; the gate is what is
    checked: once a write step ends during a busy period the next may not
    begin until a GPU step is no longer running."""

    name = "no-write-during-step"
    prop = "1. No tensor write step begins during a GPU step (an in-flight one finishes; admission never waits on it)."

    def __init__(self) -> None:
        super().__init__()
        self.in_step: int | None = None
        self.in_write = 0
        self.overlapping = False  # the write step in flight was overlapped by a GPU step
        self.steps_seen = 0
        self.overlapped_steps = 0  # GPU steps that started with an in-flight write step
        self.overlap_io = 0  # disk calls of in-flight write steps that landed during a GPU step
        self.absent = "no disk writes happened (no SSD tier in this run)"

    def on_event(self, kind: str, t: float, f: dict[str, Any]) -> None:
        if kind == "step":
            self.steps_seen += 1
            if self.in_write:
                self.overlapped_steps += 1
                self.overlapping = True
            self.in_step = f.get("n", -1)
        elif kind == "step_end" or kind == "sim_down":
            self.in_step = None
            if kind == "sim_down":
                self.in_write = 0
                self.overlapping = False
        elif kind == "write_start":
            self.absent = None
            self.checked += 1
            if self.in_step is not None:
                self.fail(t, f"write step began during GPU step {self.in_step} (the idle gate let it through)")
            self.in_write += 1
        elif kind == "write_end":
            self.in_write = max(0, self.in_write - 1)
            if not self.in_write:
                self.overlapping = False
        elif kind == "disk":  # a run of disk calls nothing else came between (sims.world.RecordingDisk)
            for op in f["ops"]:
                if op[0] == "write" or op[0] == "fsync":
                    self._disk_call(t, "disk_" + op[0], op[1])
        elif kind in ("disk_write", "disk_fsync"):
            self._disk_call(t, kind, f.get("path", ""))

    def _disk_call(self, t: float, kind: str, path: str) -> None:
        self.absent = None
        self.checked += 1
        if self.in_step is None:
            return
        if self.in_write:
            self.overlap_io += 1  # the in-flight step's own I/O
        else:
            self.fail(t, f"{kind} {path} during GPU step {self.in_step}, outside any gated write step")

    def detail(self) -> str:
        s = f"{self.checked} write steps and disk writes against {self.steps_seen} GPU steps"
        if self.overlapped_steps:
            s += (
                f"; {self.overlapped_steps} GPU steps started with a write step in flight "
                f"({self.overlap_io} disk calls of those steps landed during GPU steps)"
            )
        return s


# ---------------------------------------------------------------------------
# 2 + 3. Admission never waits (on a snapshot or anything else).


class AdmissionNeverWaits(Checker):
    """A request submitted while the Scheduler is idle is admitted at once; one
    submitted during a GPU step is admitted when that step ends (the
    Scheduler drains its inbox between steps in O(1)). Anything that makes it
    later, such as a snapshot that awaits, is a finding. Also, after every
    event, no task waits to send into the Scheduler's inbox."""

    name = "admission-never-waits"
    prop = "2/3. Admission is not delayed by write-behind; nothing waits on the admission path."

    def __init__(self, sim: SimView) -> None:
        super().__init__()
        self.sim = sim
        self.in_step = False
        self.deadline: dict[tuple[int, int], float | None] = {}  # (gen, rid) -> admit-by time (None: end of step)
        self.gen = 0
        self.waiters_seen = 0
        self.admit_t: dict[tuple[int, int], float] = {}
        self._engine: Any = None
        self._senders: Any = None  # the Scheduler inbox's waiting senders, read after every event

    def on_event(self, kind: str, t: float, f: dict[str, Any]) -> None:
        if kind == "sim_up":
            self.gen = f["gen"]
            self.in_step = False
        elif kind == "step":
            self.in_step = True
            late = [k for k, d in self.deadline.items() if d is not None and d <= t]
            for k in late:
                self.fail(
                    t,
                    f"request rid={k[1]} submitted, not admitted by t={self.deadline[k]:.6f}, and a new GPU step began",
                )
                del self.deadline[k]
        elif kind == "step_end":
            self.in_step = False
            for k, d in self.deadline.items():
                if d is None:
                    self.deadline[k] = t
        elif kind == "sim_submit":
            key = (f["gen"], f["rid"])
            if key in self.admit_t:  # the Scheduler ran before the caller resumed
                self.checked += 1
            else:
                self.deadline[key] = None if self.in_step else t
        elif kind == "admit":
            key = (self.gen, f["rid"])
            self.admit_t[key] = t
            if key not in self.deadline:
                return  # not submitted yet as the caller sees it (same instant), or not ours
            d = self.deadline.pop(key)
            self.checked += 1
            if d is not None and t > d + 1e-9:
                self.fail(t, f"request rid={f['rid']} admitted at {t:.6f}, later than {d:.6f}")
        elif kind in ("sim_down",):
            self.deadline.clear()
        engine = self.sim.engine
        if engine is not None:
            if engine is not self._engine:
                self._engine, self._senders = engine, _waiting_senders(engine.scheduler.ref)
            waiting = (
                len(self._senders)
                if self._senders is not None
                else engine.scheduler.ref.statistics().tasks_waiting_send
            )
            if waiting:
                self.waiters_seen += 1
                self.fail(t, f"{waiting} task(s) waiting to send into the Scheduler inbox (after {kind})")

    def detail(self) -> str:
        return f"{self.checked} admissions on time, inbox send-waiters seen {self.waiters_seen}"


def _waiting_senders(ref: Any) -> Any:
    """The collection whose size is the inbox's ``statistics().tasks_waiting_send``
    (the actor inbox's queue of waiting senders), read directly: building the
    statistics after each of ~500 k events was a tenth of the checkers' cost.
    None if the inbox is of another kind (then ``statistics()`` is used)."""
    waiting = getattr(getattr(getattr(ref, "_send", None), "_state", None), "waiting_senders", None)
    if waiting is None:
        return None
    try:
        return waiting if len(waiting) == ref.statistics().tasks_waiting_send else None
    except TypeError:
        return None


def compare_admissions(a: dict[tuple[int, int], float], b: dict[tuple[int, int], float]) -> list[str]:
    """Property 2 as a differential: the same trace with write-behind on and
    off admits every request at the same (virtual) time."""
    out = []
    for key in sorted(set(a) | set(b)):
        ta, tb = a.get(key), b.get(key)
        if ta is None or tb is None or abs(ta - tb) > 1e-9:
            out.append(f"rid={key[1]} (engine {key[0]}): admitted at {ta} with write-behind, {tb} without")
    return out


# ---------------------------------------------------------------------------
# 5. Restored prefixes yield the tokens of a cold prefill.


class Oracle:
    """The fake GPU's cache-free reference (``expected_tokens``), extended to
    seeded sampling and to starting from a known prefix hash, so a long agent
    context is hashed once per turn rather than once per request."""

    def __init__(self, cfg: FakeGPUConfig):
        self.cfg = cfg
        self.h0 = _initial_hash(cfg.seed)
        self.vocab = ByteTokenizer.vocab_size

    def extend(self, h: int, tokens: list[int]) -> int:
        return advance_all(h, tokens)

    def expect(
        self, prompt: list[int], sp: SamplingParams, start: tuple[int, int] | None = None
    ) -> tuple[list[int], int]:
        """(the tokens a request must get, the hash after its prompt)."""
        h, skip = start if start is not None else (self.h0, 0)
        h = self.extend(h, prompt[skip:])
        h_prompt = h
        out: list[int] = []
        append = out.append
        seed, vocab, bias = self.cfg.seed, self.vocab, self.cfg.eos_bias
        # EOS ends the answer unless ignored (-1: no token stops it)
        eos = -1 if sp.ignore_eos else ByteTokenizer.EOS
        if sp.temperature <= 0:
            for _ in range(sp.max_tokens):  # the argmax of the logits (a pure function of h, memoized)
                tok = greedy_token(seed, h, vocab, bias)
                if tok == eos:
                    break
                append(tok)
                h = _advance(h, tok)
            return out, h_prompt
        rng = np.random.Generator(np.random.PCG64(sp.seed))
        for _ in range(sp.max_tokens):
            tok = sample_token(fake_logits(seed, h, vocab, bias), sp, rng)
            if tok == eos:
                break
            append(tok)
            h = _advance(h, tok)
        return out, h_prompt


class TokensMatchColdPrefill(Checker):
    """Every answered request got exactly the oracle's tokens, whether its
    prefix came from the RAM tier, the SSD tier or a cold prefill."""

    name = "tokens-match-cold-prefill"
    prop = "5. A restored prefix yields exactly the tokens a cold prefill yields."

    def __init__(self) -> None:
        super().__init__()
        self.with_cache = 0
        self.cached_tokens = 0
        self.unchecked = 0

    def check(self, t: float, req_id: int, got: list[int], want: list[int] | None, cached: int) -> None:
        if want is None:
            self.unchecked += 1
            return
        self.checked += 1
        if cached:
            self.with_cache += 1
            self.cached_tokens += cached
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            self.fail(
                t,
                f"request {req_id} (cached={cached}) diverged at output token {i}: got {got[i : i + 4]}, cold prefill gives {want[i : i + 4]} (lengths {len(got)} vs {len(want)})",
            )

    def detail(self) -> str:
        s = f"{self.checked} requests checked, {self.with_cache} with a cached prefix ({self.cached_tokens} tokens)"
        return s + (f", {self.unchecked} unchecked (speculative sampling)" if self.unchecked else "")


# ---------------------------------------------------------------------------
# 6. The spill queue never holds more than its cap plus one item.


def find_spill_queue(engine: Engine) -> Any:
    """The engine's SpillQueue, wherever the durability actor keeps it."""
    from engine.kv.spill_queue import SpillQueue

    for holder in (getattr(engine, "durability", None), getattr(getattr(engine, "durability", None), "core", None)):
        if holder is None:
            continue
        for value in vars(holder).values():
            if isinstance(value, SpillQueue):
                return value
    return None


class SpillQueueBounded(Checker):
    name = "spill-queue-bounded"
    prop = "6. The spill queue never holds more than its cap plus one item."

    def __init__(self, sim: SimView) -> None:
        super().__init__()
        self.sim = sim
        self.absent = "the engine has no spill queue"
        self.max_over = 0
        self._engine: Any = None
        self._queue: Any = None

    def on_event(self, kind: str, t: float, f: dict[str, Any]) -> None:
        engine = self.sim.engine
        if engine is None:
            return
        if engine is not self._engine:
            self._engine, self._queue = engine, find_spill_queue(engine)
        q = self._queue
        if q is None:
            return
        self.absent = None
        self.checked += 1
        if not q.items:
            return
        over = q.pending_bytes - q.cap_bytes
        self.max_over = max(self.max_over, over)
        if over <= 0:
            return  # under the cap: no item size can make it a finding
        largest = max(i.nbytes for i in q.items)
        if over > largest:
            self.fail(
                t,
                f"spill queue holds {q.pending_bytes} bytes in {len(q.items)} items: more than its cap {q.cap_bytes} plus one item ({largest})",
            )

    def detail(self) -> str:
        return f"{self.checked} observations, most over the cap {max(self.max_over, 0)} bytes"


# ---------------------------------------------------------------------------
# 4. A flush that answered durable survives the crash after it.


@dataclass
class FlushClaim:
    t: float
    gen: int
    keys: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)  # key -> longest the cold tier held


class FlushSurvivesCrash(Checker):
    """After a flush answers durable, the cold tier holds every prefix that
    was complete before it; after a power loss and a restart, it must still
    hold at least what it held at both the flush and the moment of the crash
    (the engine may evict in between; the crash may not take anything).
    The simulator turns read faults off while it asks, and does not rot
    files at a crash this checker is watching."""

    name = "flush-survives-crash"
    prop = "4. A flush that answers durable is true after any crash that follows it."

    def __init__(self) -> None:
        super().__init__()
        self.absent = "no flush answered durable before a crash"
        self.claims: list[FlushClaim] = []
        self.flushes = 0

    def claimed(self, claim: FlushClaim) -> None:
        self.flushes += 1
        self.claims.append(claim)

    def pending(self) -> bool:
        return bool(self.claims)

    def before_crash(self, lookup: Any) -> None:
        """At the crash instant: what the engine still believed it held."""
        for claim in self.claims:
            for key, n in list(claim.keys.items()):
                claim.keys[key] = min(n, lookup(key))

    def after_restart(self, t: float, lookup: Any) -> None:
        for claim in self.claims:
            self.absent = None
            for key, n in claim.keys.items():
                if n <= 0:
                    continue
                self.checked += 1
                now = lookup(key)
                if now < n:
                    self.fail(
                        t,
                        f"flush at t={claim.t:.3f} (engine {claim.gen}) answered durable with {n} tokens of a {len(key[1])}-token prefix on SSD; after the crash only {now} are there",
                    )
        self.claims = []

    def detail(self) -> str:
        return f"{self.checked} flushed prefixes checked after crashes ({self.flushes} durable flushes)"


# ---------------------------------------------------------------------------
# 7. Every admitted request finishes once faults stop.


class Liveness(Checker):
    """In the liveness phase (faults off) every request is answered, and no
    attempt that started after the heal fails, except by backpressure
    (overload, a planned drain) or by the death of an engine that started
    before the heal (a GPU step that hung before it times out after)."""

    EXCUSED = frozenset({"EngineOverloaded", "EngineDraining"})

    name = "liveness"
    prop = "7. Every admitted request finishes once faults stop."

    def __init__(self, sim: SimView) -> None:
        super().__init__()
        self.sim = sim
        self.admitted: dict[tuple[int, int], float] = {}
        self.gen = 0
        self.up_at: dict[int, float] = {}

    def on_event(self, kind: str, t: float, f: dict[str, Any]) -> None:
        healed = self.sim.healed_at
        if kind == "sim_up":
            self.gen = f["gen"]
            self.up_at[self.gen] = t
        elif kind == "admit":
            self.admitted[(self.gen, f["rid"])] = t
        elif kind in ("finish", "abort", "fail"):
            self.admitted.pop((self.gen, f["rid"]), None)
        elif kind == "sim_down":
            for k in [k for k in self.admitted if k[0] == f["gen"]]:
                del self.admitted[k]
        elif kind == "sim_retry" and healed is not None and f["started"] > healed and f["why"] not in self.EXCUSED:
            inherited = f["why"] == "EngineDead" and self.up_at.get(f["gen"], 0.0) <= healed
            if not inherited:
                self.fail(
                    t,
                    f"request {f['id']} failed with {f['why']} on engine {f['gen']} in the liveness phase (faults off since t={healed:.3f})",
                )
        elif kind == "sim_done":
            self.checked += 1

    def end(self, t: float) -> None:
        if self.admitted:
            some = sorted(self.admitted)[:5]
            self.fail(t, f"{len(self.admitted)} admitted request(s) never finished, e.g. {some}")

    def unanswered(self, t: float, ids: list[int]) -> None:
        if ids:
            self.fail(t, f"{len(ids)} trace request(s) not answered by the drain deadline, e.g. {ids[:8]}")

    def detail(self) -> str:
        return f"{self.checked} requests answered"
