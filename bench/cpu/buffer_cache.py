"""MLX's CPU buffer cache at its default limit (32 MB) against the limit
``ember serve`` sets (engine.mlx.buffer_cache), in one process, alternating:

    python -m bench.cpu.buffer_cache --model smollm2-135m --rounds 5

Legs, at the shapes of a warm agent turn's attention (``--heads`` query
heads over ``--kv-heads``, ``--new`` queries over ``--context`` keys):

* ``QK^T``: the score matrix, as MLX's attention fallback lays it out;
* ``add``: one elementwise pass writing a matrix of that size;
* ``prefill``: the model's forward of ``--new`` tokens over ``--context``
  cached ones, as ``ember serve`` runs it (the softmax kernel on).

Prints each arm's median, the ratio default / raised (median of the per-round
ratios), and whether the prefill's logits are the same bits in both arms
(the cache changes where buffers come from, not what is computed: the script
exits 1 otherwise). Results: docs/bench/agent-session.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

MLX_DEFAULT = 32 << 20


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx import buffer_cache, softmax_kernel
    from engine.mlx import split_attention as sa
    from engine.models import resolve_model

    ap = argparse.ArgumentParser(prog="python -m bench.cpu.buffer_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--new", type=int, default=500)
    ap.add_argument("--context", type=int, default=4300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    raised = buffer_cache.wanted() or MLX_DEFAULT
    arms = {"default": MLX_DEFAULT, "raised": raised}
    rep, D = args.heads // args.kv_heads, 64
    q = mx.random.normal((1, args.kv_heads, rep, args.new, D))
    k = mx.random.normal((1, args.kv_heads, 1, args.context, D))
    x = mx.zeros((1, args.kv_heads, rep, args.new, args.context))
    mx.eval(q, k, x)

    model, _ = load(str(resolve_model(args.model)))
    sa.install(model)
    lib = softmax_kernel.load()
    toks = mx.random.randint(0, model.args.vocab_size, (1, args.context + args.new))
    cache = make_prompt_cache(model)
    for i in range(0, args.context, 512):
        model(toks[:, i : min(i + 512, args.context)], cache=cache)
        mx.eval([c.state for c in cache])

    def prefill() -> Any:
        with sa.parts(sa.default_parts(), lib):
            out = model(toks[:, args.context :], cache=cache)
            mx.eval(out)
        for layer in cache:
            layer.trim(args.new)
        return out

    legs = {
        "QK^T": lambda: mx.eval(q @ mx.swapaxes(k, -1, -2)),
        "add": lambda: mx.eval(x + 1),
        "prefill": prefill,
    }
    times: dict[str, dict[str, list[float]]] = {leg: {a: [] for a in arms} for leg in legs}
    outs: dict[str, Any] = {}
    same = True
    for r in range(args.rounds + 1):  # round 0 warms up
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            mx.set_cache_limit(arms[arm])
            mx.clear_cache()
            for leg, f in legs.items():
                f()  # the first call after clear_cache fills the cache in both arms
                t0 = time.perf_counter()
                got = f()
                if r:
                    times[leg][arm].append(time.perf_counter() - t0)
                if leg == "prefill":
                    outs[arm] = got
        same = same and bool(mx.array_equal(outs["default"], outs["raised"]).item())
        if r:
            print(f"round {r}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)

    print(
        f"\n{args.model}: {args.heads} heads / {args.kv_heads} KV heads, {args.new} new over {args.context}; "
        f"MLX's buffer cache {MLX_DEFAULT >> 20} MiB vs {raised >> 20} MiB, {args.rounds} rounds (median):\n"
    )
    print("| leg | default | raised | default / raised |")
    print("|---|---|---|---|")
    for leg, t in times.items():
        ratio = statistics.median(d / r for d, r in zip(t["default"], t["raised"]))
        med_d, med_r = statistics.median(t["default"]), statistics.median(t["raised"])
        print(f"| {leg} | {med_d * 1000:.0f} ms | {med_r * 1000:.0f} ms | {ratio:.2f}x |")
    print(f"\nprefill logits the same bits in both arms: {same}; load {os.getloadavg()[0]:.1f}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
