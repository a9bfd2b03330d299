"""Attention on MLX's CPU backend three ways, on one model in one process:
the whole ``mx.fast`` call (mlx-lm's own), split across CPU streams
(engine.mlx.split_attention) and with the softmax in the C kernel
(engine.mlx.kernel_attention, its softmax on ``--parts`` threads):

    python -m bench.cpu.split_attention --model smollm2-135m --rounds 5

Legs, each timed in every arm in every round, the arms' order rotated each
round:

* ``prefill ctx=C``: a forward of ``--new`` tokens over a cache of C tokens
  (a warm agent turn: the new tool result over the session so far);
* ``decode ctx=C bB``: one decode token for B rows over C cached tokens.

Prints the median time of each, the ratios whole / split and whole / kernel
per leg (the median of the per-round ratios), and whether each arm's logits
equal the whole call's bit for bit (they must: the script exits 1
otherwise). Results: docs/bench/agent-session.md ("The softmax kernel").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def _cache(model: Any, tokens: Any, chunk: int = 512) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, tokens.shape[1], chunk):
        model(tokens[:, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    import mlx.core as mx
    from mlx_lm import load

    from engine.mlx import softmax_kernel
    from engine.mlx import split_attention as sa
    from engine.models import resolve_model

    ap = argparse.ArgumentParser(prog="python -m bench.cpu.split_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="0,2000,4000")
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--decode", default="4000:1,4000:4,500:1", help="CONTEXT:ROWS legs")
    ap.add_argument("--parts", type=int, default=sa.default_parts())
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    lib = softmax_kernel.load()
    assert lib is not None, f"no softmax kernel: {softmax_kernel.unavailable}"
    arms: dict[str, tuple[int, Any]] = {"whole": (1, None), "split": (args.parts, None), "kernel": (args.parts, lib)}
    model, _ = load(str(resolve_model(args.model)))
    assert sa.install(model), "the model does not call mlx-lm's scaled_dot_product_attention"
    vocab = model.args.vocab_size
    mx.random.seed(0)
    legs: dict[str, Any] = {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        toks = mx.random.randint(0, vocab, (1, ctx + args.new))
        legs[f"prefill ctx={ctx} new={args.new}"] = (_cache(model, toks[:, :ctx]) if ctx else None, toks[:, ctx:])
    for leg in args.decode.split(","):
        ctx, rows = (int(x) for x in leg.split(":"))
        toks = mx.random.randint(0, vocab, (rows, ctx + 1))
        legs[f"decode ctx={ctx} b{rows}"] = (_cache(model, toks[:, :ctx]), toks[:, ctx:])

    def run(cache: Any, x: Any, arm: str) -> tuple[float, Any]:
        from mlx_lm.models.cache import make_prompt_cache

        c = cache if cache is not None else make_prompt_cache(model)
        with sa.parts(*arms[arm]):
            t0 = time.perf_counter()
            out = model(x, cache=c)
            mx.eval(out)
            dt = time.perf_counter() - t0
        for layer in c:
            layer.trim(x.shape[1])  # back to the context, for the next run
        return dt, out

    names = list(arms)
    times: dict[str, dict[str, list[float]]] = {k: {a: [] for a in names} for k in legs}
    same = {a: True for a in names}
    for cache, x in legs.values():
        for a in names:
            run(cache, x, a)  # warm up every arm
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name, (cache, x) in legs.items():
            outs = {}
            for a in order:
                dt, outs[a] = run(cache, x, a)
                times[name][a].append(dt)
            for a in names:
                same[a] = same[a] and bool(mx.array_equal(outs["whole"], outs[a]).item())
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)

    print(f"\n{args.model}, {args.parts} parts/threads, {args.rounds} rounds (median):\n")
    print(
        f"| leg | whole | split ({args.parts} streams) | kernel ({args.parts} threads) | whole / split | whole / kernel |"
    )
    print("|---|---|---|---|---|---|")
    for name, t in times.items():
        med = {a: statistics.median(t[a]) for a in names}
        ratio = {a: statistics.median(w / x for w, x in zip(t["whole"], t[a])) for a in names}
        print(
            f"| {name} | {med['whole'] * 1000:.0f} ms | {med['split'] * 1000:.0f} ms | {med['kernel'] * 1000:.0f} ms"
            f" | {ratio['split']:.2f}x | {ratio['kernel']:.2f}x |"
        )
    print(f"\nlogits bit for bit the whole call's: {same}; load {os.getloadavg()[0]:.1f}")
    if not all(same.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
