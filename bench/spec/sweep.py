"""Speculative decoding benchmark: a γ sweep for both drafters against no speculation.

    python -m bench.spec.sweep                         # bundled tiny + tiny-draft, 3 rounds
    python -m bench.spec.sweep --rounds 5 --tokens 256
    python -m bench.spec.sweep --model PATH --draft PATH --out results.md

Every configuration runs as its own engine (same target weights, same
process): speculation off (γ = 0), prompt lookup (``ngram``) and the draft
model at γ = 1..4 and adaptive. Rounds are interleaved (round r runs every
configuration once, in a rotated order), so a burst of load on this shared
machine hits all of them alike; the report gives, per configuration, the
decode throughput of its best round and the ratios to speculation off
measured in the same run (best round to best round, and median to median). Decode throughput is (tokens - 1) / (time of the last token - time
of the first token) per request, greedy, EOS ignored, so prefill is out.

Workloads:

* ``free``: open-ended continuations of short code prompts;
* ``grounded``: continuing a file whose content repeats — a source excerpt
  given twice, the prompt cut inside the second copy, so the continuation is
  in the input;
* ``batch4``: four ``free`` prompts at once (aggregate tokens/s), speculation
  verified inside the running batch.

Acceptance per γ is accepted / drafted over the run; for adaptive γ the
histogram of chosen γ is printed too. A second engine without speculation
("off again") runs as a control: its ratio to the first is how far two
identical configurations drift apart in this run.
"""

# Over 500 lines on purpose (issue 18): the sweep and the paired runner share the
# prompts, Config/Arm and the engine set-up; the reports are in bench.spec.report.
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.spec.report import Config, ceiling, fmt_ratio, paired_report, report  # noqa: F401 - ceiling, fmt_ratio: the names tests import from here
from engine.speculation import model_free

FREE_PROMPTS = [
    "def parse_args(argv):\n    ",
    "class Cache:\n    def __init__(self, size):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    '"""Utilities for reading and writing files."""\n\n',
]


def grounded_prompts(tokenizer: Any, n: int = 3, excerpt_tokens: int = 200) -> list[list[int]]:
    """Source excerpts given twice, cut a few tokens into the second copy."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[list[int]] = []
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py"):
        path = stdlib / name
        if not path.is_file():
            continue
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        start = len(ids) // 3
        excerpt = ids[start : start + excerpt_tokens]
        out.append(excerpt + excerpt[:12])
        if len(out) == n:
            break
    return out


def workload_prompts(tokenizer: Any, n: int) -> dict[str, list[list[int]]]:
    """The three workloads' prompts as token ids (``n`` per sequential workload)."""
    return {
        "free": [tokenizer.encode(p) for p in FREE_PROMPTS[:n]],
        "grounded": grounded_prompts(tokenizer, n=n),
        "batch4": [tokenizer.encode(p) for p in FREE_PROMPTS[:4]],
    }


def common_args(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options this bench shares with ``bench.spec.adaptive``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per sequential workload")
    ap.add_argument("--workloads", default="free,grounded,batch4")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    return ap


async def stream_times(engine: Any, prompt: Any, params: Any) -> tuple[int, float, Any]:
    """Tokens, seconds from the first token to the last, and usage."""
    first = last = None
    n = 0
    usage = None
    async for d in engine.agenerate(prompt, params):
        if d.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(d.token_ids)
        if d.usage is not None:
            usage = d.usage
    return n, (last - first) if first and last else 0.0, usage


async def run_workload(cfg: Config, workload: str, prompts: list[Any], params: Any) -> None:
    engine = cfg.engine
    if workload == "batch4":
        t0 = time.perf_counter()
        results = await asyncio.gather(*[stream_times(engine, p, params) for p in prompts])
        tokens = sum(n for n, _, _ in results)
        tps = tokens / (time.perf_counter() - t0)
        usages = [u for _, _, u in results]
    else:
        tokens, secs, usages = 0, 0.0, []
        for p in prompts:
            n, s, u = await stream_times(engine, p, params)
            tokens += n - 1
            secs += s
            usages.append(u)
        tps = tokens / secs
    cfg.tps.setdefault(workload, []).append(tps)
    for u in usages:
        spec = u.speculation if u is not None else None
        if spec is not None:
            cfg.drafted[workload] = cfg.drafted.get(workload, 0) + spec.drafted
            cfg.accepted[workload] = cfg.accepted.get(workload, 0) + spec.accepted
            cfg.rounds[workload] = cfg.rounds.get(workload, 0) + spec.target_calls


async def main_async(args: argparse.Namespace) -> str:
    from ember import Engine, EngineConfig, SamplingParams

    gammas = [int(g) for g in args.gammas.split(",")]
    # A second engine without speculation: its ratio to the first is this run's noise floor.
    configs = [Config("off (γ=0)", None, None), Config("off again (control)", None, None)]
    for drafter, label in (("ngram", "ngram"), (args.draft, "draft")):
        for g in gammas:
            configs.append(Config(f"{label} γ={g}", drafter, g))
        configs.append(Config(f"{label} adaptive", drafter, None))

    base = dict(model=args.model, max_batch=8, prompt_cache_gib=0)
    async with contextlib_stack() as stack:
        for c in configs:
            cfg = EngineConfig(**base, draft_model=c.drafter, num_draft_tokens=c.gamma)
            c.engine = await stack.enter_async_context(Engine.open(cfg, ports=timing_ports(args)))
        tok = configs[0].engine.tokenizer
        prompts = workload_prompts(tok, args.prompts)
        workloads = [w for w in args.workloads.split(",") if w in prompts]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        warm = SamplingParams(max_tokens=8, ignore_eos=True)
        for c in configs:  # first-call costs (kernels, allocations) stay out of the numbers
            await c.engine.acomplete(prompts["free"][0], warm)
        for r in range(args.rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for w in workloads:
                for c in order:
                    await run_workload(c, w, prompts[w], params)
            print(f"[bench_spec] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        meta = {
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
            "blas": os.environ.get("LD_PRELOAD", "") or "reference (no preload)",
            "model": args.model,
            "draft": args.draft,
        }
        width_ms, draft_step_ms = verify_width_cost(args.model, args.draft, args.rounds)
        text = report(configs, workloads, args, meta, width_ms, draft_step_ms)
        print(text, flush=True)  # before the anatomy: the sweep's numbers are kept whatever happens next
        if args.out:
            args.out.write_text(text + "\n")
        if args.anatomy:
            lines = [
                "",
                "Round anatomy (one request, `free` and `grounded` prompt 1, low quartile ms):",
                "",
                "| config | workload | round | draft ask | device step | verify ask | tokens / round | ms / token |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for c in configs:
                for w in ("free", "grounded"):
                    a = await anatomy(c.engine, prompts[w][0], params)
                    lines.append(
                        f"| {c.name} | {w} | {a['round']:.2f} | {a['draft']:.2f} | {a['step']:.2f} | "
                        f"{a['verify']:.2f} | {a['tokens_per_round']:.2f} | {a['round'] / a['tokens_per_round']:.2f} |"
                    )
            anatomy_text = "\n".join(lines)
        else:
            anatomy_text = ""
        return text + anatomy_text


def verify_width_cost(
    model_name: str, draft_name: str, rounds: int, steps: int = 100, widths: int = 5
) -> tuple[dict[int, float], float | None]:
    """Median ms of a target forward over n = 1..5 tokens (a verify window of
    γ = n − 1), and of a one-token draft-model step, at one OpenBLAS thread as
    the engine runs them for one row. In a child process: MLX driven from this
    process's main thread beside the engines' MLX threads aborted the
    interpreter at exit, now and then."""
    code = (
        "import json, sys\n"
        "from bench.cpu.forward import verify_costs\n"
        "print(json.dumps(verify_costs(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))))\n"
    )
    argv = [sys.executable, "-c", code, model_name, draft_name, str(max(1, rounds)), str(steps), str(widths)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    width, draft = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(n): ms for n, ms in width.items()}, draft


class RoundTimes:
    """The engines' phase observer (``ember.Ports.observer``, installed with
    ``--anatomy``): the Drafter ask, the device step and the Verifier ask of
    each round, while ``on``. A round starts at its draft ask (at the step
    when nothing was drafted)."""

    def __init__(self) -> None:
        self.on = False
        self.reset()

    def reset(self) -> None:
        self.rec: dict[str, list[float]] = {"draft": [], "step": [], "verify": []}
        self.starts: list[float] = []
        self._drafted: float | None = None

    def phase(self, name: str, start: float, seconds: float) -> None:
        if not self.on:
            return
        self.rec[name].append(seconds)
        if name == "draft":
            self._drafted = start
        elif name == "step":
            self.starts.append(start if self._drafted is None else self._drafted)
            self._drafted = None


def timing_ports(args: argparse.Namespace) -> Any:
    """The ports an engine of this benchmark is opened with: a ``RoundTimes``
    observer when the anatomy was asked for (None times nothing)."""
    from ember import Ports

    return Ports(observer=RoundTimes() if args.anatomy else None)


async def anatomy(engine: Any, prompt: Any, params: Any) -> dict[str, float]:
    """Where a round's time goes for one request: the Drafter ask (draft-model
    forwards included), the device step, the Verifier ask, and the whole
    round (start to start). Low quartiles over the rounds of one request, ms.
    The engine was opened with ``timing_ports``."""
    times = engine.parts.ports.observer
    assert isinstance(times, RoundTimes), "open the engine with timing_ports(args)"
    times.reset()  # a fresh record for this request
    times.on = True
    try:
        n, _, usage = await stream_times(engine, prompt, params)
    finally:
        times.on = False
    rec: dict[str, list[float]] = {**times.rec, "round": [b - a for a, b in zip(times.starts, times.starts[1:])]}

    def q(v: list[float]) -> float:
        return sorted(v)[len(v) // 4] * 1000 if v else 0.0

    spec = usage.speculation if usage is not None else None
    per_round = (n / max(1, spec.target_calls)) if spec else 1.0
    return {**{k: q(v) for k, v in rec.items()}, "tokens_per_round": per_round}


# ---------------------------------------------------------------------------
# Paired sweep on a chat model: agent-shaped workloads, speculation on/off on
# one engine.

AGENT_WORKLOADS = ("chat", "edit", "copy", "agent")


@dataclass
class Arm:
    """One speculation setting on one engine: a fixed γ, or adaptive (None);
    ``control``: plain decode again, the same requests as the plain run it is
    divided by, so its ratio is what the harness alone moves (order, load)."""

    drafter: str
    gamma: int | None
    control: bool = False
    ratios: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (workload, batch) -> per round
    tps: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    drafted: dict[tuple[str, int], int] = field(default_factory=dict)
    accepted: dict[tuple[str, int], int] = field(default_factory=dict)
    calls: dict[tuple[str, int], int] = field(default_factory=dict)
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)
    identical: dict[tuple[str, int], list[bool]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        label = self.drafter if model_free(self.drafter) else Path(self.drafter).name
        if self.control:
            return f"{label} plain again"
        return f"{label} {'adaptive' if self.gamma is None else f'γ={self.gamma}'}"


async def _one(engine: Any, prompt: list[int], params: Any, ns: str = "") -> tuple[list[int], float, Any]:
    """Token ids, seconds from the first token to the last, usage."""
    ids: list[int] = []
    first = last = None
    usage = None
    async for d in engine.agenerate(prompt, params, ns=ns):
        if d.token_ids:
            last = time.perf_counter()
            first = first or last
            ids.extend(d.token_ids)
        if d.usage is not None:
            usage = d.usage
    return ids, (last - first) if first and last else 0.0, usage


async def run_paired_cell(
    engine: Any, workload: str, batch: int, n: int, params: Any, ns: str = ""
) -> tuple[float, list[list[int]], list[Any]]:
    """Decode tok/s of one workload at one batch size, the outputs (for the
    greedy-identity check) and the usages. Batch 1: ``n`` requests (agent:
    sessions) one after another, tokens over first→last token time. Batch b:
    b requests (sessions) at once, prompts cycled, tokens over wall time.
    ``ns``: the cell's cache namespace — suffix decoding drafts from the
    earlier requests of its namespace, so each cell gets its own: a cell
    learns from its own earlier turns and sessions, never from another arm's
    or round's run of the same requests (which would repeat them exactly)."""
    from bench.spec import workloads as sw

    tok = engine.tokenizer
    if workload == "agent":

        async def session(s: Any) -> tuple[list[list[int]], list[Any], int, float]:
            outs, usages, tokens, secs = [], [], 0, 0.0
            for _ in range(s.TURNS):
                ids, dt, u = await _one(engine, s.next_prompt(tok), params, ns)
                s.answered(tok.decode(ids))
                outs.append(ids)
                usages.append(u)
                tokens, secs = tokens + max(0, len(ids) - 1), secs + dt
            return outs, usages, tokens, secs

        k = len(sw.EDIT_FILES)
        count = n if batch == 1 else batch
        # fresh sessions (they record their turns), files cycled
        picked = [sw.agent_sessions(k)[i % k] for i in range(count)]
        t0 = time.perf_counter()
        if batch == 1:
            results = [await session(s) for s in picked]
        else:
            results = await asyncio.gather(*[session(s) for s in picked])
        wall = time.perf_counter() - t0
        outs = [o for r in results for o in r[0]]
        usages = [u for r in results for u in r[1]]
        if batch == 1:
            return sum(r[2] for r in results) / max(1e-9, sum(r[3] for r in results)), outs, usages
        return sum(len(o) for o in outs) / wall, outs, usages
    make = {"chat": sw.chat_prompts, "edit": sw.edit_prompts, "copy": sw.copy_prompts}[workload]
    pool = make(tok, len(sw.CHAT_PROMPTS) if workload == "chat" else len(sw.EDIT_FILES))
    if batch == 1:
        res = [await _one(engine, p, params, ns) for p in pool[:n]]
        tps = sum(max(0, len(i) - 1) for i, _, _ in res) / max(1e-9, sum(dt for _, dt, _ in res))
    else:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_one(engine, pool[i % len(pool)], params, ns) for i in range(batch)])
        tps = sum(len(i) for i, _, _ in res) / (time.perf_counter() - t0)
    return tps, [i for i, _, _ in res], [u for _, _, u in res]


async def paired_async(args: argparse.Namespace) -> str:
    """Every arm of a drafter runs on that drafter's engine, each (workload,
    batch) beside that engine's plain decode (``speculate=false``) of the
    same requests in the same round. Plain decode takes its turn in the
    rotation like every arm (the order changes per round), and a control arm
    decodes plainly again: its ratio to plain is the harness's own bias."""
    import msgspec

    from ember import Engine, EngineConfig, SamplingParams

    drafters = [d for d in args.drafters.split(",") if d]
    gammas = [int(g) for g in args.gammas.split(",") if g]
    workloads = [w for w in args.workloads.split(",") if w in AGENT_WORKLOADS]
    batches = [int(b) for b in args.batches.split(",")]
    base = SamplingParams(max_tokens=args.tokens)  # EOS ends an answer, as in use
    off_params = msgspec.structs.replace(base, speculate=False)
    arms = {d: [Arm(d, g) for g in gammas] + [Arm(d, None), Arm(d, None, control=True)] for d in drafters}
    off_tps: dict[tuple[str, str, int], list[float]] = {}
    anat: list[str] = []
    t_start = time.perf_counter()
    async with contextlib_stack() as stack:
        engines = {}
        for d in drafters:
            cfg = EngineConfig(model=args.model, max_batch=max(8, max(batches)), prompt_cache_gib=0, draft_model=d)
            engines[d] = await stack.enter_async_context(Engine.open(cfg, ports=timing_ports(args)))
            await engines[d].acomplete(engines[d].encode("Hello"), SamplingParams(max_tokens=4))
        for r in range(args.rounds):
            for w in workloads:
                for b in batches:
                    if b > 1 and w not in args.batch_workloads.split(","):
                        continue
                    for d in drafters:
                        eng = engines[d]
                        runs: list[Arm | None] = [None, *arms[d]]  # None: the plain run
                        # Rotated, and reversed every other round: a rotation alone
                        # keeps each run's predecessor, and what ran just before
                        # can slow a run (memory, caches).
                        k = (r // 2) % len(runs)
                        runs = runs[k:] + runs[:k]
                        runs = runs[::-1] if r % 2 else runs
                        runs = [
                            a for a in runs if a is None or b == 1 or a.control or a.gamma in (None, *args.batch_gammas)
                        ]
                        measured = []
                        for arm in runs:
                            if arm is None or arm.control:
                                p = off_params
                            elif arm.gamma is None:
                                p = base
                            else:
                                p = msgspec.structs.replace(base, num_draft_tokens=arm.gamma)
                            ns = f"r{r}-{'plain' if arm is None else arm.name}-{w}-{b}"
                            measured.append((arm, await run_paired_cell(eng, w, b, args.prompts, p, ns)))
                        off, off_outs, _ = next(m for a, m in measured if a is None)
                        off_tps.setdefault((d, w, b), []).append(off)
                        for arm, (tps, outs, usages) in measured:
                            if arm is None:
                                continue
                            key = (w, b)
                            arm.ratios.setdefault(key, []).append(tps / off)
                            arm.tps.setdefault(key, []).append(tps)
                            arm.identical.setdefault(key, []).append(outs == off_outs)
                            for u, o in zip(usages, outs):
                                sp = u.speculation if u is not None else None
                                if sp is not None:
                                    arm.drafted[key] = arm.drafted.get(key, 0) + sp.drafted
                                    arm.accepted[key] = arm.accepted.get(key, 0) + sp.accepted
                                    arm.calls[key] = arm.calls.get(key, 0) + sp.target_calls
                                    arm.tokens[key] = arm.tokens.get(key, 0) + len(o)
                    print(
                        f"[bench_spec] round {r + 1}/{args.rounds} {w} batch {b} done "
                        f"({(time.perf_counter() - t_start) / 60:.1f} min)",
                        file=sys.stderr,
                        flush=True,
                    )
            if args.out:  # what is measured so far survives an interrupted run
                partial = {d: engines[d].stats().get("speculation", {}) for d in drafters}
                args.out.write_text(
                    paired_report(
                        args,
                        drafters,
                        workloads,
                        batches,
                        arms,
                        off_tps,
                        partial,
                        {},
                        {},
                        [],
                        time.perf_counter() - t_start,
                    )
                    + f"\n\n(after round {r + 1})\n"
                )
        if args.anatomy:
            anat = await paired_anatomy(engines, workloads, args, base)
        stats = {d: engines[d].stats().get("speculation", {}) for d in drafters}
    width_ms: dict[int, float] = {}
    draft_ms: dict[str, float | None] = {}
    if args.widths:
        for d in drafters:
            width_ms, draft_ms[d] = verify_width_cost(args.model, d, 1, steps=args.width_steps, widths=max(gammas) + 1)
    return paired_report(
        args,
        drafters,
        workloads,
        batches,
        arms,
        off_tps,
        stats,
        width_ms,
        draft_ms,
        anat,
        time.perf_counter() - t_start,
    )


async def paired_anatomy(
    engines: dict[str, Any], workloads: list[str], args: argparse.Namespace, base: Any
) -> list[str]:
    """Where a round's time goes, one request at batch 1 (the first prompt of
    ``chat`` and ``edit``), plain and at γ = 3 and adaptive."""
    import msgspec

    from bench.spec import workloads as sw

    lines = [
        "Round anatomy (one request, batch 1, low quartile ms): the Drafter ask (draft-model forwards "
        "included), the device step, the Verifier ask, and the whole round start to start.",
        "",
        "| drafter | workload | setting | round | draft ask | device step | verify ask | tokens / round | ms / token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d, eng in engines.items():
        tok = eng.tokenizer
        for w in [w for w in workloads if w in ("chat", "edit", "copy")]:
            prompt = {"chat": sw.chat_prompts, "edit": sw.edit_prompts, "copy": sw.copy_prompts}[w](tok, 1)[0]
            for label, p in (
                ("plain", msgspec.structs.replace(base, speculate=False)),
                ("γ=3", msgspec.structs.replace(base, num_draft_tokens=3)),
                ("adaptive", base),
            ):
                a = await anatomy(eng, prompt, p)
                lines.append(
                    f"| {Path(d).name} | {w} | {label} | {a['round']:.1f} | {a['draft']:.1f} | {a['step']:.1f} | "
                    f"{a['verify']:.1f} | {a['tokens_per_round']:.2f} | {a['round'] / a['tokens_per_round']:.1f} |"
                )
    return lines


def contextlib_stack():
    import contextlib

    return contextlib.AsyncExitStack()


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = common_args(__doc__, rounds=5)
    ap.add_argument("--gammas", default=None, help="fixed γ to run (default 1,2,3,4; --paired: 1,2,3,4,5,6)")
    ap.add_argument("--anatomy", action="store_true", help="also time the parts of a round, per configuration")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="the chat/edit/agent sweep: every γ paired with speculate=false on the same engine",
    )
    ap.add_argument("--drafters", default="ngram", help="--paired: comma-separated drafters, one engine each")
    ap.add_argument("--batches", default="1", help="--paired: batch sizes, e.g. 1,4,8")
    ap.add_argument("--batch-workloads", default="chat,edit,agent", help="--paired: workloads run at batch > 1")
    ap.add_argument("--batch-gammas", default="3", help="--paired: fixed γ also run at batch > 1 (adaptive always)")
    ap.add_argument(
        "--widths",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--paired: measure verify-forward widths for the ceiling columns",
    )
    ap.add_argument("--width-steps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.paired:
        if args.workloads == "free,grounded,batch4":
            args.workloads = "chat,edit,copy,agent"
        if args.gammas is None:  # only the default widens: a γ list given by hand runs as given
            args.gammas = "1,2,3,4,5,6"
        args.batch_gammas = tuple(int(g) for g in args.batch_gammas.split(",") if g)
        text = asyncio.run(paired_async(args))
        print(text, flush=True)
        if args.out:
            args.out.write_text(text + "\n")
        return
    args.gammas = args.gammas or "1,2,3,4"
    text = asyncio.run(main_async(args))
    if args.anatomy:
        print(text[text.index("\nRound anatomy") :] if "\nRound anatomy" in text else "")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
