"""Attention split across CPU streams (engine.mlx.split_attention) against
the whole call, on one model in one process:

    python -m bench.cpu.split_attention --model smollm2-135m --rounds 5

Legs, each timed split (``--parts``, default one per core) and whole in
every round, the order reversed every other round:

* ``prefill ctx=C``: a forward of ``--new`` tokens over a cache of C tokens
  (a warm agent turn: the new tool result over the session so far);
* ``decode ctx=C bB``: one decode token for B rows over C cached tokens.

Prints the median time of each, the ratio whole / split per leg (the median
of the per-round ratios), and whether the split's logits equal the whole
call's bit for bit (they must: the script exits 1 otherwise). Results:
docs/bench/agent-session.md ("Attention across cores").
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

    def run(cache: Any, x: Any, n: int) -> tuple[float, Any]:
        from mlx_lm.models.cache import make_prompt_cache

        c = cache if cache is not None else make_prompt_cache(model)
        with sa.parts(n):
            t0 = time.perf_counter()
            out = model(x, cache=c)
            mx.eval(out)
            dt = time.perf_counter() - t0
        for layer in c:
            layer.trim(x.shape[1])  # back to the context, for the next run
        return dt, out

    times: dict[str, dict[int, list[float]]] = {k: {1: [], args.parts: []} for k in legs}
    same = True
    for cache, x in legs.values():
        run(cache, x, 1), run(cache, x, args.parts)  # warm up both
    for r in range(args.rounds):
        order = [1, args.parts] if r % 2 == 0 else [args.parts, 1]
        for name, (cache, x) in legs.items():
            outs = {}
            for n in order:
                dt, outs[n] = run(cache, x, n)
                times[name][n].append(dt)
            same = same and bool(mx.array_equal(outs[1], outs[args.parts]).item())
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)

    print(f"\n{args.model}, {args.parts} parts vs whole, {args.rounds} rounds (median):\n")
    print(f"| leg | whole | split ({args.parts} parts) | whole / split |")
    print("|---|---|---|---|")
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t[1], t[args.parts])]
        w, s = statistics.median(t[1]), statistics.median(t[args.parts])
        print(f"| {name} | {w * 1000:.0f} ms | {s * 1000:.0f} ms | {statistics.median(ratios):.2f}x |")
    print(f"\nlogits bit for bit the whole call's: {same}; load {os.getloadavg()[0]:.1f}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
