"""A decode step, Ember's against mlx-lm's, split into its parts, in one process:

    python -m bench.cpu.decode_step --model smollm2-135m
    python -m bench.cpu.decode_step --model smollm2-135m --arms plain,ngram,nokernel --rounds 4 --out docs/bench/decode-step.md

One process, one model directory, OpenBLAS preloaded (``maybe_reexec_with_openblas``).
Every round runs each leg once at batch 1 and at batch ``--rows``, the legs
in alternating order (reversed every other round), and the report gives each
leg's median over the rounds and its ratio to mlx-lm's own step:

* ``mlx_lm``: ``mlx_lm.generate.generate_step`` (batch 1) or
  ``BatchGenerator.next_generated`` (batch B) on mlx-lm's own model object:
  ms per step, the same loop ``mlx_lm.server`` runs;
* ``ember:ARM``: Ember's ``Engine`` in this process (the MLX thread, the
  actors, the backend's step and its run-ahead), ms per step between the
  first and the last token (batch B: B requests submitted together).
  Arms: ``plain`` (``ember serve``'s defaults without a drafter), ``ngram``
  (serve's defaults: prompt lookup on), ``nokernel`` (plain, no softmax
  kernel, no attention split), ``noshare`` (plain, the prefill share off);
* ``agg:mlx_lm`` / ``agg:ARM`` (batch B): the B streams' aggregate from
  submission to the last token (prefill and joining included, as a server's
  8-stream leg measures it), in ms per token of the batch;
* the parts, on Ember's own model object (weights as the engine laid them
  out): ``forward`` (``DecodeBatch.decode`` + ``mx.eval``: the model alone,
  mlx-lm's forward), ``sample`` (log-softmax, argmax, ``tolist`` on B rows),
  ``proposer`` (prompt lookup's ``extend`` + ``propose`` for B rows of a
  context where it finds nothing: what the n-gram drafter costs per step
  when it proposes nothing); ``overhead`` = ``ember:plain`` − forward −
  sample: the backend's step (batch.py, rows.py, step_sampling.py), the
  Scheduler's loop and the streaming, per step.

Each Ember arm's backend counters are printed beside it (steps run ahead and
kept, run-ahead steps undone, attention calls in the softmax kernel): a leg
whose run-ahead is undone, or whose decode calls go through the kernel's
``mx.eval``, pays for it here. Absolute times on a shared machine are noisy;
quote the ratios and the load (printed). Results: docs/bench/decode-step.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ARMS = ("plain", "ngram", "nokernel", "noshare")


def engine_config(model: str, arm: str) -> Any:
    """``ember serve``'s defaults (prefill share 0.5, the kernel and the split
    as configured by default), without the SSD tier or the RAM prompt cache:
    every round decodes the same way."""
    from engine.config import EngineConfig

    kw: dict[str, Any] = {"model": model, "prefill_share": 0.5, "prompt_cache_gib": 0.0}
    if arm == "ngram":
        kw["draft_model"] = "ngram"
    elif arm == "nokernel":
        kw.update(attention_streams=1, softmax_kernel=False)
    elif arm == "noshare":
        kw["prefill_share"] = None  # the full prefill chunk every step (the embedded Engine's default)
    elif arm != "plain":
        raise SystemExit(f"unknown arm {arm!r} (one of {', '.join(ARMS)})")
    return EngineConfig(**kw)


def code_ids(tok: Any) -> list[int]:
    """Token ids of the standard library's source (as bench.serve.vs_mlx_lm's prompts)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("[a-m]*.py"))[:60])
    return list(tok.encode(text))


def prompts_for(ids: list[int], rows: int, n_tokens: int, rnd: int) -> list[list[int]]:
    """``rows`` code prompts of ``n_tokens`` tokens (the standard library's
    source: a code continuation, nothing copied), a new offset each round."""
    return [ids[5000 + 300 * i + 7 * rnd : 5000 + 300 * i + 7 * rnd + n_tokens] for i in range(rows)]


async def ember_step_ms(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """ms per decode step of ``len(prompts)`` streams, first token to last, and
    ms per generated token from submission to the last token (the aggregate)."""
    from engine.types import SamplingParams

    stamps: list[float] = []

    async def one(p: list[int]) -> None:
        async for _ in engine.agenerate(p, SamplingParams(max_tokens=tokens, ignore_eos=True)):
            stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*[one(p) for p in prompts])
    first = sorted(stamps)[len(prompts) - 1]  # every stream has its first token
    return (max(stamps) - first) / (tokens - 1) * 1e3, (max(stamps) - t0) / (tokens * len(prompts)) * 1e3


def mlx_step_ms(model: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """ms per step of mlx-lm's own loop: generate_step (1 row), BatchGenerator
    (more); and ms per generated token from the start (prefill included)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generate_step

    t0 = time.perf_counter()
    if len(prompts) == 1:
        stamps = [time.perf_counter() for _ in generate_step(mx.array(prompts[0]), model, max_tokens=tokens)]
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, (stamps[-1] - t0) / len(stamps) * 1e3
    gen = BatchGenerator(model, max_tokens=tokens)
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    stamps = []
    while True:
        out = gen.next_generated()
        if not out:
            break
        stamps.append(time.perf_counter())
        if all(r.finish_reason is not None for r in out) and len(stamps) >= tokens:
            break
    gen.close()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, (stamps[-1] - t0) / (tokens * len(prompts)) * 1e3


def part_fns(model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """The parts of a step, each a callable timing one step of it (ms)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx.batch import DecodeBatch, merge_caches
    from engine.speculation.ngram import NgramIndex

    rows = len(prompts)
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        mx.eval([x.state for x in c])
        caches.append(c)
    batch = DecodeBatch()
    batch.add(list(range(rows)), merge_caches(caches))
    toks = mx.array([p[-1] for p in prompts])
    vocab = model.args.vocab_size
    logits = mx.random.normal((rows, 1, vocab))
    mx.eval(logits)
    # a context that repeats nothing: prompt lookup finds no n-gram of its suffix
    idx = [NgramIndex() for _ in range(rows)]
    for i, ix in enumerate(idx):
        ix.extend(list(range(1000 * i, 1000 * i + 512)))
    nxt = [1000 * i + 512 for i in range(rows)]

    def timed(fn: Any) -> Any:
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return run

    def forward() -> None:
        mx.eval(batch.decode(model, toks))
        batch.trim([1] * rows)

    def sample() -> None:
        raw = logits[:, -1, :]
        t = mx.argmax(raw - mx.logsumexp(raw, axis=-1, keepdims=True), axis=-1)
        mx.eval(t)
        t.tolist()

    def proposer() -> None:
        for i, ix in enumerate(idx):
            ix.extend([nxt[i]])
            nxt[i] += 1
            ix.propose(4, min_match=4)

    return {"forward": timed(forward), "sample": timed(sample), "proposer": timed(proposer)}


def median_of(samples: list[float], n: int = 9) -> float:
    return statistics.median(samples[-n:])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx_lm

    from ember.api import Engine
    from engine.mlx import kernel_attention
    from engine.mlx.blas import blas_threads
    from engine.models import resolve_model

    path = str(resolve_model(args.model))
    arms = [a for a in args.arms.split(",") if a]
    batches = [int(b) for b in args.batches.split(",")]
    ref_model, tok = mlx_lm.load(path)
    ids = code_ids(tok)
    blas = blas_threads()
    legs: dict[tuple[int, str], list[float]] = {}
    counters: dict[tuple[int, str], dict[str, int]] = {}
    loads = [os.getloadavg()[0]]
    async with AsyncExitStack() as stack:
        engines = {a: await stack.enter_async_context(Engine.open(engine_config(path, a))) for a in arms}
        backends: dict[str, Any] = {a: e.backend for a, e in engines.items()}  # MLXBackend (counters, model)
        own_model = backends[arms[0]].model  # Ember's layout (pretransposed linears)
        for B in batches:
            warm = prompts_for(ids, B, args.prompt_tokens, 99)
            mlx_step_ms(ref_model, warm, 4)
            for e in engines.values():
                await ember_step_ms(e, warm, 4)
            # mlx-lm's legs and the parts run at the OpenBLAS thread count Ember's
            # decode step of B rows uses (--mlx-threads ember), so the ratio is the
            # step's, not OpenBLAS's: on a loaded machine its default threads spin
            # threads: where Ember's float32 layers take its own kernel (engine.mlx.fmm_linear,
            # on its own threads), Ember's OpenBLAS count no longer describes its matmuls, and
            # mlx-lm's legs get OpenBLAS's default (every core): its matmuls need them
            own = backends[arms[0]].counters.get("fmm_kernel_layers", 0) > 0
            threads = backends[arms[0]].cpu_threads.threads_for(B) if args.mlx_threads == "ember" and not own else 0
            blas.use(threads)
            parts = part_fns(own_model, prompts_for(ids, B, args.prompt_tokens, 0)) if args.parts else {}
            for r in range(args.rounds):
                prompts = prompts_for(ids, B, args.prompt_tokens, r)
                order = ["mlx_lm", *[f"ember:{a}" for a in arms], *parts]
                for leg in order if r % 2 == 0 else order[::-1]:
                    blas.use(threads)  # the engine sets OpenBLAS's (process-wide) threads per step
                    if leg == "mlx_lm":
                        v, agg = mlx_step_ms(ref_model, prompts, args.tokens)
                        if B > 1:
                            legs.setdefault((B, "agg:mlx_lm"), []).append(agg)
                    elif leg.startswith("ember:"):
                        e = engines[leg[6:]]
                        counts = backends[leg[6:]].counters
                        before = dict(counts)
                        k0 = kernel_attention.calls["kernel"]
                        v, agg = await ember_step_ms(e, prompts, args.tokens)
                        if B > 1:
                            legs.setdefault((B, f"agg:{leg[6:]}"), []).append(agg)
                        c = counters.setdefault((B, leg), {})
                        for name in ("pipelined", "undone"):
                            c[name] = c.get(name, 0) + counts[name] - before.get(name, 0)
                        c["kernel_calls"] = c.get("kernel_calls", 0) + kernel_attention.calls["kernel"] - k0
                        c["steps"] = c.get("steps", 0) + args.tokens
                    else:
                        v = statistics.median(parts[leg]() for _ in range(args.part_steps))
                    legs.setdefault((B, leg), []).append(v)
                print(
                    f"[decode_step] B={B} (OpenBLAS threads {threads or blas.default}) round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{k[1]} {v[-1]:.1f}" for k, v in legs.items() if k[0] == B),
                    file=sys.stderr,
                    flush=True,
                )
                loads.append(os.getloadavg()[0])
    return {"legs": legs, "counters": counters, "loads": loads, "arms": arms, "batches": batches}


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    legs, counters = res["legs"], res["counters"]
    lines = []
    for B in res["batches"]:
        med = {leg: statistics.median(v) for (b, leg), v in legs.items() if b == B}
        if "ember:plain" in med and "forward" in med:
            med["overhead"] = med["ember:plain"] - med["forward"] - med["sample"]
        ref = med["mlx_lm"]
        lines += [
            f"### batch {B}",
            "",
            "| leg | ms per step (median) | vs mlx_lm's step | tok/s | mlx_lm's tok/s ÷ this | counters |",
            "|---|---|---|---|---|---|",
        ]
        for leg, ms in med.items():
            if leg.startswith("agg:"):
                ref_leg = med["agg:mlx_lm"]
                tps = 1e3 / ms
                lines.append(
                    f"| {leg} | {ms:.2f} per token | {ms / ref_leg:.2f} (agg) | {tps:.1f} | {ref_leg / ms:.2f}x |  |"
                )
                continue
            tps = B * 1e3 / ms if leg.startswith(("mlx_lm", "ember:")) else None
            c = counters.get((B, leg))
            cs = ", ".join(f"{k} {v}" for k, v in c.items()) if c else ""
            lines.append(
                f"| {leg} | {ms:.2f} | {ms / ref:.2f} | {f'{tps:.1f}' if tps else ''} | "
                f"{f'{ref / ms:.2f}x' if tps else ''} | {cs} |"
            )
        lines.append("")
    loads = res["loads"]
    head = (
        f"`python -m bench.cpu.decode_step --model {args.model} --arms {','.join(res['arms'])} "
        f"--rounds {args.rounds} --tokens {args.tokens} --mlx-threads {args.mlx_threads}`; load average {min(loads):.1f}-{max(loads):.1f} "
        f"(machine of {os.cpu_count()} cores); medians over {args.rounds} alternated rounds. "
        "'mlx_lm's tok/s ÷ this' above 1.00x: Ember decodes faster."
    )
    return head + "\n\n" + "\n".join(lines)


def ratios(res: dict[str, Any], arm: str = "plain") -> dict[int, float]:
    """mlx-lm's median over Ember's ``arm``'s (above 1: Ember faster): the decode
    step at batch 1, the aggregate from submission (prefill included) above."""
    legs, out = res["legs"], {}
    for B in res["batches"]:
        mine, ref = (f"ember:{arm}", "mlx_lm") if B == 1 else (f"agg:{arm}", "agg:mlx_lm")
        if (B, mine) in legs:
            out[B] = statistics.median(legs[(B, ref)]) / statistics.median(legs[(B, mine)])
    return out


def parse_floors(text: str) -> dict[int, float]:
    """``1=0.9,8=1.0`` -> {1: 0.9, 8: 1.0}; a clear error on anything else."""
    out = {}
    for item in filter(None, text.split(",")):
        b, sep, r = item.partition("=")
        try:
            out[int(b)] = float(r)
        except ValueError:
            raise SystemExit(f"--min-ratio wants BATCH=RATIO pairs, e.g. 1=0.9,8=1.0; got {item!r}") from None
        if not sep:
            raise SystemExit(f"--min-ratio wants BATCH=RATIO pairs; got {item!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.decode_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--arms", default="plain,ngram", help=f"Ember arms, comma-separated: {','.join(ARMS)}")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per stream per leg")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--part-steps", type=int, default=9, help="steps timed per part per round (their median)")
    ap.add_argument(
        "--mlx-threads",
        choices=["ember", "default"],
        default="ember",
        help="OpenBLAS threads of mlx-lm's legs and the parts: Ember's choice for the batch (default; "
        "OpenBLAS's default where Ember's float32 layers take its own kernel) or OpenBLAS's default "
        "(as a separate mlx_lm.server runs)",
    )
    ap.add_argument("--no-parts", dest="parts", action="store_false", help="only the mlx_lm and ember legs")
    ap.add_argument("--out", help="write the report (markdown) here too")
    ap.add_argument(
        "--min-ratio",
        default="",
        metavar="B=R,...",
        help="the guard: exit 1 when mlx-lm's step over Ember's plain step falls below R at batch B "
        "(docs/bench/decode-guard.md)",
    )
    args = ap.parse_args(argv)
    floors = parse_floors(args.min_ratio)
    res = asyncio.run(run(args))
    text = report(res, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if floors:
        got = ratios(res)
        low = {b: r for b, r in got.items() if b in floors and r < floors[b]}
        for b, r in got.items():
            verdict = "BELOW" if b in low else "ok"
            print(f"guard: batch {b}: Ember plain {r:.2f}x mlx-lm's step (floor {floors.get(b, 0):.2f}) {verdict}")
        if low:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
