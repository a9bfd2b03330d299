"""Speculative decoding benchmark: a γ sweep for both drafters against no speculation.

    python -m sims.bench_spec                         # bundled tiny + tiny-draft, 3 rounds
    python -m sims.bench_spec --rounds 5 --tokens 256
    python -m sims.bench_spec --model PATH --draft PATH --out results.md

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

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    """The options this bench shares with ``sims.bench_adaptive``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per sequential workload")
    ap.add_argument("--workloads", default="free,grounded,batch4")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    return ap


@dataclass
class Config:
    name: str
    drafter: str | None
    gamma: int | None  # None with a drafter: adaptive
    engine: Any = None
    tps: dict[str, list[float]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)


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


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}×"


def ceiling(
    per_call: float | None, gamma: int | None, width_ms: dict[int, float] | None, draft_step_ms: float = 0.0
) -> float | None:
    """Speedup a fixed-γ configuration would reach with no per-round overhead:
    the tokens it gains per target call over what the round's forwards cost
    against a one-token target step — the (γ+1)-token verify, plus γ drafter
    steps of ``draft_step_ms`` each (0: a drafter that costs nothing). Above
    1.0 the engine has room to win; below it no engine work can make that γ
    pay, at the acceptance this pair reaches."""
    if per_call is None or gamma is None or not width_ms or gamma + 1 not in width_ms:
        return None
    return per_call / ((width_ms[gamma + 1] + gamma * draft_step_ms) / width_ms[1])


def report(
    configs: list[Config],
    workloads: list[str],
    args: argparse.Namespace,
    meta: dict[str, str],
    width_ms: dict[int, float] | None = None,
    draft_step_ms: float | None = None,
) -> str:
    base = configs[0]
    lines = [
        f"Command: `python -m sims.bench_spec {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"Machine: {meta['machine']}; BLAS: {meta['blas']}; target `{meta['model']}`, "
        f"drafter `{meta['draft']}`; {args.tokens} tokens per request, greedy, {args.rounds} interleaved "
        "rounds. Ratios are against speculation off in the same run: of the best round (interference on a "
        "shared machine only ever slows a round down, so the best round is the least disturbed one) and of "
        "the medians.",
        "",
    ]
    if width_ms:
        lines += [
            "Verify forward cost on the target, same run (`sims.bench_forward` width leg, 1 OpenBLAS thread, "
            "batch 1): " + ", ".join(f"n={n} {ms / width_ms[1]:.2f}×" for n, ms in width_ms.items())
            + " of n=1"
            + (f"; a one-token step of the draft model {draft_step_ms / width_ms[1]:.2f}× of the target's" if draft_step_ms else "")
            + ". The last columns of the one-request workloads are the speedup each fixed γ would reach with no "
            "per-round overhead: tokens per target call ÷ the cost of the γ+1-token verify forward, with a drafter "
            "that costs nothing and, for the draft model, with its γ measured steps added.",
            "",
        ]
    for w in workloads:
        b_best, b_med = max(base.tps[w]), statistics.median(base.tps[w])
        bounded = width_ms is not None and w != "batch4"  # the width cost was measured at batch 1
        lines += [
            f"### {w}",
            "",
            "| config | tok/s (best round) | speedup (best) | speedup (median) | acceptance | tokens / target call |"
            + (" ceiling, free drafter | ceiling, this drafter |" if bounded else ""),
            "|---|---|---|---|---|---|" + ("---|---|" if bounded else ""),
        ]
        for c in configs:
            best, med = max(c.tps[w]), statistics.median(c.tps[w])
            acc = c.accepted.get(w, 0) / c.drafted[w] if c.drafted.get(w) else None
            per_call = None
            if c.rounds.get(w):
                per_call = (c.rounds[w] + c.accepted.get(w, 0)) / c.rounds[w]
            row = (
                f"| {c.name} | {best:.1f} | {fmt_ratio(best / b_best)} | {fmt_ratio(med / b_med)} | "
                f"{'–' if acc is None else f'{acc:.0%}'} | {'–' if per_call is None else f'{per_call:.2f}'} |"
            )
            if bounded:
                gamma = c.gamma if c.drafter else None
                cap = ceiling(per_call, gamma, width_ms)
                # prompt lookup is a Python scan (0.1 ms a round in the anatomy): its own ceiling is the free one
                own = cap if c.drafter == "ngram" else ceiling(per_call, gamma, width_ms, draft_step_ms or 0.0) if draft_step_ms else None
                row += f" {'–' if cap is None else fmt_ratio(cap)} | {'–' if own is None else fmt_ratio(own)} |"
            lines.append(row)
        lines.append("")
    adaptive = [c for c in configs if c.drafter and c.gamma is None]
    if adaptive:
        lines += ["Adaptive γ chosen (all workloads, rounds per γ):", ""]
        for c in adaptive:
            st = c.engine.stats().get("speculation", {})
            lines.append(f"- {c.name}: {st.get('gamma_chosen')}; round cost fit {st.get('policy', {}).get('round_s_fit')}")
        lines.append("")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    from engine import Engine, EngineConfig, SamplingParams

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
            c.engine = await stack.enter_async_context(Engine.open(cfg))
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
            lines = ["", "Round anatomy (one request, `free` and `grounded` prompt 1, low quartile ms):", "",
                     "| config | workload | round | draft ask | device step | verify ask | tokens / round | ms / token |",
                     "|---|---|---|---|---|---|---|---|"]
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


def verify_width_cost(model_name: str, draft_name: str, rounds: int) -> tuple[dict[int, float], float | None]:
    """Median ms of a target forward over n = 1..5 tokens (a verify window of
    γ = n − 1), and of a one-token draft-model step, at one OpenBLAS thread as
    the engine runs them for one row. In a child process: MLX driven from this
    process's main thread beside the engines' MLX threads aborted the
    interpreter at exit, now and then."""
    code = (
        "import json, sys\n"
        "from sims.bench_forward import verify_costs\n"
        "print(json.dumps(verify_costs(sys.argv[1], sys.argv[2], int(sys.argv[3]))))\n"
    )
    argv = [sys.executable, "-c", code, model_name, draft_name, str(max(1, rounds))]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    width, draft = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(n): ms for n, ms in width.items()}, draft


async def anatomy(engine: Any, prompt: Any, params: Any) -> dict[str, float]:
    """Where a round's time goes for one request: the Drafter ask (draft-model
    forwards included), the device step, the Verifier ask, and the whole
    round (start to start). Low quartiles over the rounds of one request, ms."""
    sch = engine.scheduler
    rec: dict[str, list[float]] = {"draft": [], "step": [], "verify": [], "round": []}
    orig_draft, orig_verify, orig_run = sch._draft, sch._verify, engine.device.run
    starts: list[float] = []
    orig_step = sch._step

    async def draft(*a):
        t = time.perf_counter()
        try:
            return await orig_draft(*a)
        finally:
            rec["draft"].append(time.perf_counter() - t)

    async def verify(*a):
        t = time.perf_counter()
        try:
            return await orig_verify(*a)
        finally:
            rec["verify"].append(time.perf_counter() - t)

    async def step(*a):
        starts.append(time.perf_counter())
        return await orig_step(*a)

    async def run(fn, *a, cost_s=0.0):
        t = time.perf_counter()
        try:
            return await orig_run(fn, *a, cost_s=cost_s)
        finally:
            if getattr(fn, "__name__", "") == "step":
                rec["step"].append(time.perf_counter() - t)

    sch._draft, sch._verify, sch._step, engine.device.run = draft, verify, step, run
    try:
        n, _, usage = await stream_times(engine, prompt, params)
    finally:
        sch._draft, sch._verify, sch._step = orig_draft, orig_verify, orig_step
        engine.device.run = orig_run
    rec["round"] = [b - a for a, b in zip(starts, starts[1:])]

    def q(v: list[float]) -> float:
        return sorted(v)[len(v) // 4] * 1000 if v else 0.0

    spec = usage.speculation if usage is not None else None
    per_round = (n / max(1, spec.target_calls)) if spec else 1.0
    return {**{k: q(v) for k, v in rec.items()}, "tokens_per_round": per_round}


def contextlib_stack():
    import contextlib

    return contextlib.AsyncExitStack()


def main(argv: list[str] | None = None) -> None:
    from engine.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = common_args(__doc__, rounds=5)
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--anatomy", action="store_true", help="also time the parts of a round, per configuration")
    args = ap.parse_args(argv)
    text = asyncio.run(main_async(args))
    if args.anatomy:
        print(text[text.index("\nRound anatomy"):] if "\nRound anatomy" in text else "")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
