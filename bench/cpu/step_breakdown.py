"""Where a B-row decode step's time goes, Ember's path next to mlx-lm's ``BatchGenerator``:

    python -m bench.cpu.step_breakdown --model <mlx-lm dir> --rows 8 --threads 1,2

Same process, same model, same OpenBLAS thread count (each count in turn), B
prompts of the same length (an aligned batch, as in a steady 8-stream decode).
Every round times each part for ``--steps`` steps, the parts in alternating
order, and the report gives the median per part (ms per step):

* ``ember_step``: ``DecodeBatch.decode`` + log-softmax + argmax, ``mx.eval``
  and ``tolist`` (what ``MLXBackend`` does per decode step, without running
  ahead); ``batchgen_next``: mlx-lm's ``BatchGenerator.next()`` on the same
  prompts (its own pipelining, its per-row logprobs);
* the forward split: ``forward`` (the model), ``body`` (without the head),
  ``head`` (the LM head on ``[B, 1, hidden]``), ``linears`` (every ``Linear``
  of the body alone, on ``[B, 1, K]`` inputs), ``linears_fused`` (the same
  with q|k|v and gate|up concatenated: fewer, larger matmuls), ``sdpa``
  (attention over a cache of the prompts' length, once per layer);
  ``other`` = body − linears − sdpa (norms, RoPE, reshapes, residuals);
* ``sample``: log-softmax + argmax + ``tolist`` on fixed logits;
  ``graph_build``: Python time to build one step's lazy graph.

Results: docs/gguf.md ("Where an 8-row decode step goes").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

PROMPTS = [
    "The capital of France is",
    "Write a poem about the sea and the",
    "def add(a, b):\n    return",
    "Once upon a time, in a land far",
    "The quick brown fox",
    "List three colors:",
    "In 1492, Columbus",
    "Python is a programming language that",
]


def _batch(model: Any, prompts: list[list[int]]) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx.batch import DecodeBatch, merge_caches

    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        mx.eval([x.state for x in c])
        caches.append(c)
    b = DecodeBatch()
    b.add(list(range(len(prompts))), merge_caches(caches))
    return b


def parts(model: Any, prompts: list[list[int]]) -> dict[str, Callable[[], Any]]:
    """One callable per part; each runs one step of it to completion."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import BatchGenerator

    rows, args = len(prompts), model.args
    toks = mx.array([p[-1] for p in prompts])
    ember, fwd, body = _batch(model, prompts), _batch(model, prompts), _batch(model, prompts)
    last = {"t": toks}

    def sample_of(logits: mx.array) -> mx.array:
        raw = logits[:, -1, :]
        return mx.argmax(raw - mx.logsumexp(raw, axis=-1, keepdims=True), axis=-1)

    def ember_step() -> None:
        t = sample_of(ember.decode(model, last["t"]))
        mx.eval(t)
        t.tolist()
        last["t"] = t

    gen = BatchGenerator(model, max_tokens=1_000_000)
    gen.insert(prompts, max_tokens=[1_000_000] * rows)
    for _ in range(3):
        gen.next()

    hidden = mx.random.normal((rows, 1, args.hidden_size))
    logits = mx.random.normal((rows, 1, args.vocab_size))
    head = model.model.embed_tokens.as_linear if getattr(args, "tie_word_embeddings", False) else model.lm_head
    lins = [m for _, m in model.model.named_modules() if isinstance(m, nn.Linear)]
    fused = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        fused += [
            mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            a.o_proj.weight,
            mx.concatenate([m.gate_proj.weight, m.up_proj.weight]),
            m.down_proj.weight,
        ]
    xs = {k: mx.random.normal((rows, 1, k)) for k in {m.weight.shape[1] for m in lins}}
    n_kv, head_dim = (
        args.num_key_value_heads,
        getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
    )
    q = mx.random.normal((rows, args.num_attention_heads, 1, head_dim))
    k = mx.random.normal((rows, n_kv, len(prompts[0]) + 32, head_dim))
    v = mx.random.normal(k.shape)
    mx.eval(hidden, logits, fused, list(xs.values()), q, k, v)

    def graph_build() -> None:
        out = sample_of(fwd.decode(model, toks))
        fwd.trim([1] * rows)
        t0 = time.perf_counter()
        out = sample_of(fwd.decode(model, toks))
        graph_build.last = time.perf_counter() - t0  # type: ignore[attr-defined]
        mx.eval(out)
        fwd.trim([1] * rows)

    def forward() -> None:
        mx.eval(fwd.decode(model, toks))
        fwd.trim([1] * rows)

    def body_only() -> None:
        mx.eval(model.model(toks[:, None], cache=body.cache))
        body.trim([1] * rows)

    return {
        "ember_step": ember_step,
        "batchgen_next": gen.next,
        "forward": forward,
        "body": body_only,
        "head": lambda: mx.eval(head(hidden)),
        "linears": lambda: mx.eval([m(xs[m.weight.shape[1]]) for m in lins]),
        "linears_fused": lambda: mx.eval([xs[w.shape[1]] @ w.T for w in fused]),
        "sdpa": lambda: mx.eval(
            [mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5) for _ in model.model.layers]
        ),
        "sample": lambda: sample_of(logits).tolist(),
        "graph_build": graph_build,
    }


def measure(fns: dict[str, Callable[[], Any]], rounds: int, steps: int) -> dict[str, float]:
    """Median ms per step of each part, the parts' order reversed every round."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for f in fns.values():
        f()
    for r in range(rounds):
        for name in names if r % 2 else names[::-1]:
            for _ in range(steps):
                t0 = time.perf_counter()
                fns[name]()
                dt = time.perf_counter() - t0
                samples[name].append(getattr(fns[name], "last", dt) if name == "graph_build" else dt)
    out = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    out["other"] = out["body"] - out["linears"] - out["sdpa"]
    return out


def main() -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m or an mlx-lm directory")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", default="1,2", help="OpenBLAS thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="steps per part per round")
    args = ap.parse_args()

    from mlx_lm import load

    from engine.mlx.blas import blas_threads
    from engine.models import resolve_model

    model, tok = load(str(resolve_model(args.model)))
    prompts = [tok.encode(p)[:5] for p in (PROMPTS * (args.rows // len(PROMPTS) + 1))[: args.rows]]
    blas = blas_threads()
    results = {}
    for n in (int(x) for x in args.threads.split(",")):
        blas.use(n)
        results[n] = measure(parts(model, prompts), args.rounds, args.steps)
    cols = list(results)
    print(f"ms per {args.rows}-row step (median), load average {os.getloadavg()[0]:.1f}")
    print("| part | " + " | ".join(f"{c} thread(s)" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name in results[cols[0]]:
        print(f"| {name} | " + " | ".join(f"{results[c][name]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
