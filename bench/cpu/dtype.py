"""Decode speed of one model kept in float32, bfloat16 and 4-bit, side by side (docs/gguf.md, "Which dtype"):

    python -m bench.cpu.dtype --model smollm2-135m          # 5 rounds, 64 tokens
    python -m bench.cpu.dtype --model tiny --rounds 1 --tokens 8

The dtype ``ember convert`` and ``ember serve FILE.gguf`` choose by default rests on this. The three
copies are loaded once each (``mlx_lm.load`` of ``resolve_model(NAME)``, then ``set_dtype`` or
``nn.quantize(bits=4, group_size=64)`` on the layers whose width 64 divides); each round times a
greedy 1-token decode of ``--tokens`` steps on a warm cache for every dtype, the order rotating
round by round. Prints per dtype the median ms per token, tok/s, the ratio of medians to float32
and the median of the per-round ratios, every per-round ratio, and the load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

DTYPES = ("float32", "bfloat16", "4-bit")


def _load(name: str, dtype: str):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    from engine.models import resolve_model

    model, _ = load(str(resolve_model(name)))
    if dtype == "4-bit":
        model.set_dtype(mx.float32)
        nn.quantize(
            model,
            group_size=64,
            bits=4,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
    else:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def _decode_ms(model, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([list(range(1, 17))]), cache=cache)
    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
        mx.eval(tok)
    return (time.perf_counter() - t0) * 1e3 / tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    load0 = os.getloadavg()[0]
    models = {d: _load(args.model, d) for d in DTYPES}
    for m in models.values():
        _decode_ms(m, args.tokens)  # warm: a full untimed run each
    ms: dict[str, list[float]] = {d: [] for d in DTYPES}
    for r in range(args.rounds):
        order = DTYPES[r % 3 :] + DTYPES[: r % 3]
        for d in order:
            ms[d].append(_decode_ms(models[d], args.tokens))
    load1 = os.getloadavg()[0]
    base = statistics.median(ms["float32"])
    print(
        f"bench.cpu.dtype: `{args.model}`, {args.rounds} rounds x {args.tokens} greedy decode steps, "
        f"order rotating; load {load0:.2f} -> {load1:.2f} (1-min)"
    )
    print()
    print("| dtype | ms/token (median) | tok/s | float32 time / this (of medians) | paired (median of rounds) |")
    print("|---|---|---|---|---|")
    for d in DTYPES:
        med = statistics.median(ms[d])
        paired = statistics.median(a / b for a, b in zip(ms["float32"], ms[d]))
        print(f"| {d} | {med:.2f} | {1e3 / med:.1f} | {base / med:.2f}x | {paired:.2f}x |")
    print()
    for d in DTYPES[1:]:
        rounds = ", ".join(f"{a / b:.2f}x" for a, b in zip(ms["float32"], ms[d]))
        print(f"- per-round float32/{d}: {rounds}")
    fastest = min(DTYPES, key=lambda d: statistics.median(ms[d]))
    print(f"- fastest decode here: **{fastest}** (by the median over all {args.rounds} rounds)")


if __name__ == "__main__":
    main()
