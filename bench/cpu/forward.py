"""Micro-benchmarks of single forwards on the bundled target, side by side:

    python -m bench.cpu.forward            # the first three legs
    python -m bench.cpu.forward --legs width,mask,prefill,layout --rounds 8
    python -m bench.cpu.forward --legs verify --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b

* ``verify`` (alone): the width leg and a drafter's one-token step, each model
  loaded as the engine loads it (weight format, quantized-matmul kernel, CPU
  layout): what a speculation round costs (docs/bench/spec-real.md).
* ``width``: a forward over n = 1..5 tokens on a warm KV cache (a verify
  window of γ = n − 1), one OpenBLAS thread as the engine runs it; ratio to
  n = 1 (docs/bench/spec.md, finding 5).
* ``mask``: batch-1 decode, pipelined like ``generate_step``, through mlx-lm's
  ``KVCache``, its ``BatchKVCache`` (which builds an all-True mask every step)
  and a ``BatchKVCache`` stepped without it as ``engine.mlx.batch.DecodeBatch``
  does (docs/bench/engine.md, item 8).
* ``prefill``: eight 48-token prompts prefilled one by one (B=1 each) vs in one
  ``(8, 48)`` forward, as ``MLXBackend._prefill_together`` does
  (docs/mlx-backend.md).
* ``layout``: the width leg's forwards (n = 1..5 at batch 1) and a batch-4
  decode step on mlx-lm's weight layout vs the same weights stored ``W.T``
  (``engine.mlx.cpu_layout``, what the engine runs on a CPU), one OpenBLAS thread
  (docs/mlx-backend.md).

Each leg alternates its variants round by round and prints medians and the
ratios; single numbers on this shared machine move by tens of percent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def width_leg(model: Any, ids: list[int], rounds: int, steps: int = 100, widths: int = 5) -> dict[int, float]:
    """Median ms of a forward over n tokens on a 300-token cache, n = 1..widths."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(ids[:300])[None], cache=cache))
    out: dict[int, list[float]] = {n: [] for n in range(1, widths + 1)}
    for _ in range(rounds):
        for n in out:
            x = mx.array(ids[300 : 300 + n])[None]
            ts = []
            for _ in range(steps):
                ts.append(_timed(lambda: mx.eval(mx.argmax(model(x, cache=cache)[0], axis=-1))))  # noqa: B023 -- called here
                for c in cache:
                    c.trim(n)
            out[n].append(1000 * statistics.median(ts))
    return {n: statistics.median(v) for n, v in out.items()}


def mask_leg(model: Any, ids: list[int], rounds: int, steps: int = 200) -> dict[str, float]:
    """Decode tok/s of a batch-1 greedy loop through three cache kinds."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from engine.mlx.batch import DecodeBatch, merge_caches

    def run(kind: str) -> float:
        cache = make_prompt_cache(model)
        logits = model(mx.array(ids[:64])[None], cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)
        if kind == "KVCache":
            step = lambda t: model(t[:, None], cache=cache)  # noqa: E731
        else:
            batch = DecodeBatch()
            batch.add([0], merge_caches([cache]))
            assert all(type(c) is BatchKVCache for c in batch.cache)
            if kind == "BatchKVCache":
                step = lambda t: model(t[:, None], cache=batch.cache)  # noqa: E731
            else:
                step = lambda t: batch.decode(model, t)  # noqa: E731
        nxt = mx.argmax(step(y)[:, -1], axis=-1)
        mx.async_eval(nxt)
        t0 = time.perf_counter()
        for _ in range(steps):
            y = nxt
            nxt = mx.argmax(step(y)[:, -1], axis=-1)
            mx.async_eval(nxt)
            y.item()
        return steps / (time.perf_counter() - t0)

    kinds = ["KVCache", "BatchKVCache", "BatchKVCache, no mask (DecodeBatch.decode)"]
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds[r % 3 :] + kinds[: r % 3]:
            out[k].append(run(k))
    return {k: statistics.median(v) for k, v in out.items()}


def prefill_leg(model: Any, ids: list[int], rounds: int) -> dict[str, float]:
    """Median ms to prefill eight 48-token prompts, alone vs together."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rows = [ids[i * 300 : i * 300 + 48] for i in range(8)]

    def alone() -> None:
        for r in rows:
            c = make_prompt_cache(model)
            model(mx.array(r)[None], cache=c)
            mx.eval([x.state for x in c])

    def together() -> None:
        c = make_prompt_cache(model)
        model(mx.array(rows), cache=c)
        mx.eval([x.state for x in c])

    alone()  # warm-up
    together()
    a, b = [], []
    for _ in range(rounds):
        a.append(1000 * _timed(alone))
        b.append(1000 * _timed(together))
    return {"8 x B=1": statistics.median(a), "one (8, 48) forward": statistics.median(b)}


def layout_leg(model_name: str, ids: list[int], rounds: int, steps: int = 60) -> dict[str, dict[str, float]]:
    """Median ms of the width leg's forwards and of a batch-4 decode step on
    mlx-lm's layout vs ``W.T`` (two loads of one checkpoint), the two
    alternating within each round."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx.cpu_layout import pretranspose_linears
    from engine.models import resolve_model

    path = str(resolve_model(model_name))
    models = {"mlx-lm layout": load(path)[0], "W.T (engine)": load(path)[0]}
    pretranspose_linears(models["W.T (engine)"])
    out: dict[str, dict[str, list[float]]] = {k: {} for k in models}

    def batch4(m: Any) -> float:
        cache = make_prompt_cache(m)
        mx.eval(m(mx.array([ids[i * 300 : i * 300 + 300] for i in range(4)]), cache=cache))
        x = mx.array([[ids[1200 + i]] for i in range(4)])
        ts = []
        for _ in range(steps):
            ts.append(_timed(lambda: mx.eval(mx.argmax(m(x, cache=cache)[:, -1], axis=-1))))
            for c in cache:
                c.trim(1)
        return 1000 * statistics.median(ts)

    for r in range(rounds):
        for name in list(models)[r % 2 :] + list(models)[: r % 2]:
            m = models[name]
            for n, ms in width_leg(m, ids, 1, steps).items():
                out[name].setdefault(f"n={n}", []).append(ms)
            out[name].setdefault("B=4 decode", []).append(batch4(m))
    return {k: {s: statistics.median(v) for s, v in d.items()} for k, d in out.items()}


def load_with_ids(model_name: str) -> tuple[Any, Any, list[int]]:
    """The model, its tokenizer, and the token ids every leg feeds (textwrap.py, three times)."""

    from mlx_lm import load

    from engine.models import resolve_model

    model, tok = load(str(resolve_model(model_name)))
    return model, tok, _leg_ids(tok)


def _leg_ids(tok: Any) -> list[int]:
    """The token ids every leg feeds: textwrap.py, three times."""
    import sysconfig
    from pathlib import Path

    return tok.encode((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text() * 3)


def verify_costs(
    model_name: str, draft_name: str, rounds: int, steps: int = 100, widths: int = 5
) -> tuple[dict[int, float], float | None]:
    """The width leg at one OpenBLAS thread (as the engine runs a 1-row step),
    and a one-token step of the draft model (None for ``ngram`` and ``suffix``), median ms:
    what bench.spec.sweep's ceiling columns divide by."""
    import mlx.core as mx

    from engine.config import EngineConfig
    from engine.mlx import qmm_linear
    from engine.mlx.blas import blas_threads
    from engine.mlx.loading import read_model
    from engine.models import resolve_model
    from engine.speculation import model_free

    # the engine's own load: its weight format, the quantized-matmul kernel and the CPU layout
    # (a quantized target timed through MLX's own quantized_matmul would price a step ~3x too high)
    loaded = read_model(resolve_model(model_name), EngineConfig(model=model_name))
    model, ids = loaded.model, _leg_ids(loaded.tokenizer)
    blas_threads().use(1)
    width = width_leg(model, ids, rounds, steps, widths)
    draft = None
    if not model_free(draft_name):  # load_model: a drafter may ship without a tokenizer (it borrows the target's)
        from mlx_lm.utils import load_model

        # draft=True: the format the engine drafts in (the 0.5B in q8, not the float32 it is served in alone)
        drafter = load_model(resolve_model(draft_name, draft=True))[0]
        if mx.default_device() == mx.cpu:
            qmm_linear.install(drafter)  # as engine.mlx.draft_model does
        draft = width_leg(drafter, ids, rounds, steps, 1)[1]
    return width, draft


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import blas_threads, maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.forward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--legs", default="width,mask,prefill")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--draft", default=None, help="the verify leg: a draft model whose one-token step is timed too")
    ap.add_argument("--widths", type=int, default=5, help="the verify leg: forwards over n = 1..WIDTHS tokens")
    args = ap.parse_args(argv)
    if args.legs == "verify":  # loads as the engine does (verify_costs), not as the other legs
        width, draft = verify_costs(args.model, args.draft or "ngram", args.rounds, 10, args.widths)
        print(f"`{args.model}` as the engine loads it, forward over n tokens on a warm cache (median ms):")
        for n, ms in width.items():
            print(f"  n={n}: {ms:7.1f} ms  {ms / width[1]:.2f}x of n=1")
        if draft is not None:
            print(
                f"  one-token step of the drafter `{args.draft}`: {draft:.1f} ms, {draft / width[1]:.2f}x of the target's"
            )
        return

    model, tok, ids = load_with_ids(args.model)
    legs = args.legs.split(",")
    if "width" in legs:
        blas_threads().use(1)
        w = width_leg(model, ids, args.rounds)
        print("forward over n tokens on a 300-token cache, 1 OpenBLAS thread (median ms):")
        for n, ms in w.items():
            print(f"  n={n}: {ms:6.2f} ms  {ms / w[1]:.2f}x of n=1")
    if "mask" in legs:
        blas_threads().use(1)
        m = mask_leg(model, ids, args.rounds)
        base = m["KVCache"]
        print("batch-1 greedy decode, pipelined (median tok/s):")
        for k, v in m.items():
            print(f"  {k:45s} {v:6.0f}  {v / base:.3f}x of KVCache")
    if "prefill" in legs:
        blas_threads().use(0)
        p = prefill_leg(model, ids, args.rounds)
        a, b = p.values()
        print("prefill of eight 48-token prompts (median ms):")
        for k, v in p.items():
            print(f"  {k:22s} {v:7.1f} ms")
        print(f"  together / alone: {b / a:.2f}x")
    if "layout" in legs:
        blas_threads().use(1)
        lay = layout_leg(args.model, ids, args.rounds)
        (na, la), (nb, lb) = lay.items()
        print(f"forwards on a warm cache, 1 OpenBLAS thread (median ms): {na} | {nb} | ratio")
        for shape in la:
            print(f"  {shape:11s} {la[shape]:6.2f} | {lb[shape]:6.2f} | {lb[shape] / la[shape]:.2f}x")
        print(f"  verify window n=4 over n=1: {la['n=4'] / la['n=1']:.2f}x | {lb['n=4'] / lb['n=1']:.2f}x")


if __name__ == "__main__":
    main()
