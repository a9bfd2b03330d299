"""Constrained vs unconstrained decoding throughput on the bundled model.

    python -m bench.serve.constrained                  # 8 streams, 5 rounds each
    python -m bench.serve.constrained --streams 8 --rounds 7 --tokens 160

One engine (``tiny``, batch 8, no prompt cache); each round runs ``streams``
concurrent requests of one kind, and the kinds alternate round by round so
a burst of load on a shared machine hits both alike:

* ``json_schema``: ``response_format``-style constraint on a schema whose
  output is long enough to decode for ``--tokens`` (an array of bounded
  strings; the grammar forces the length), sampled at temperature 0.8;
* ``plain``: the same prompts, no constraint, EOS ignored, each stream's
  ``max_tokens`` the length of the same stream's output in the constrained
  round before it (so the batch shrinks the same way as rows finish), same
  temperature.

Throughput is the round's generated tokens / its wall time (prefill of a
short prompt included, alike for both). On a shared machine wall time swings
by several times between rounds, so the round's process CPU time per token
(``time.process_time``: every thread of this process, MLX's and BLAS's
included) is reported too: what the work costs, whoever else is running.
The report gives the median over rounds of each kind and their ratios; every
constrained output is checked to parse and validate against the schema
(``jsonschema``). Last, ``mask_cost`` times the host work constraining adds
to a decode step of ``streams`` rows (feed the sampled token to each matcher,
compute its bitmask, apply the batch's masks in MLX) in thread CPU time,
without the model: the part of the difference that load cannot blur.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

PROMPTS = [
    "def parse_args(argv):\n    ",
    "class Cache:\n    def __init__(self, size):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    '"""Utilities for reading and writing files."""\n\n',
    "x = [1, 2, 3]\n",
    "# notes\n",
    "config = ",
    "for i in range(10):\n",
]


def schema(items: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 4, "maxLength": 16},
            "notes": {
                "type": "array",
                "items": {"type": "string", "minLength": 12, "maxLength": 24},
                "minItems": items,
                "maxItems": items,
            },
            "done": {"type": "boolean"},
        },
        "required": ["title", "notes", "done"],
        "additionalProperties": False,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    from ember import Engine, EngineConfig, SamplingParams
    from engine.types import Constraint

    sch = schema(args.items)
    c = Constraint(kind="json_schema", source=json.dumps(sch))
    cfg = EngineConfig(model=args.model, max_batch=args.streams, prompt_cache_gib=0)
    rates: dict[str, list[float]] = {"json_schema": [], "plain": []}
    cpu_ms: dict[str, list[float]] = {"json_schema": [], "plain": []}
    lengths: list[int] = []
    invalid = 0
    async with Engine.open(cfg) as engine:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
        # warm-up: compile the grammar, touch both paths
        await engine.acomplete(prompts[0], SamplingParams(max_tokens=8, temperature=0.8, seed=0, constraint=c))
        await engine.acomplete(prompts[0], SamplingParams(max_tokens=8, temperature=0.8, seed=0, ignore_eos=True))
        plain_tokens = [args.tokens] * args.streams
        for r in range(args.rounds * 2):
            kind = "json_schema" if r % 2 == 0 else "plain"
            if kind == "json_schema":
                params = [
                    SamplingParams(max_tokens=args.tokens * 2, temperature=0.8, seed=1000 * r + i, constraint=c)
                    for i in range(args.streams)
                ]
            else:
                params = [
                    SamplingParams(max_tokens=plain_tokens[i], temperature=0.8, seed=1000 * r + i, ignore_eos=True)
                    for i in range(args.streams)
                ]
            t0, c0 = time.perf_counter(), time.process_time()
            done = await asyncio.gather(*[engine.acomplete(p, sp) for p, sp in zip(prompts, params)])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = sum(len(d.token_ids) for d in done)
            rates[kind].append(n / dt)
            cpu_ms[kind].append(cpu / n * 1000)
            if kind == "json_schema":
                for d in done:
                    lengths.append(len(d.token_ids))
                    try:
                        jsonschema.validate(json.loads(d.text), sch)
                    except (ValueError, jsonschema.ValidationError):
                        invalid += 1
                plain_tokens = [max(1, len(d.token_ids)) for d in done]
            print(
                f"round {r} {kind:11s} {n:5d} tokens {dt:6.2f} s {n / dt:8.1f} tok/s {cpu / n * 1000:6.2f} CPU ms/token",
                flush=True,
            )
        backend = engine.backend.stats()
        grammars = dict(engine.backend.grammars.counters)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
    return {
        "streams": args.streams,
        "rounds": args.rounds,
        "median_tok_s": med,
        "ratio_wall": med["json_schema"] / med["plain"],
        "median_cpu_ms_per_token": cpu,
        "ratio_cpu": cpu["plain"] / cpu["json_schema"],  # throughput ratio implied by CPU cost
        "rates": rates,
        "cpu_ms": cpu_ms,
        "mean_constrained_tokens": statistics.mean(lengths),
        "invalid": invalid,
        "outputs": len(lengths),
        "backend": {k: backend[k] for k in ("pipelined", "undone")},
        "grammars": grammars,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
    }


def mask_cost(model: str, streams: int, items: int, steps: int = 150) -> dict[str, float]:
    """CPU ms per step that constraining ``streams`` rows adds, by part."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from engine.mlx.grammar import Grammars
    from engine.mlx.logits import RowLogits, apply_words
    from engine.models import resolve_model
    from engine.types import Constraint, SamplingParams

    _, tok = load(str(resolve_model(model)))
    vocab = len(tok._tokenizer)
    eos = sorted(tok.eos_token_ids)
    grammars = Grammars(tok._tokenizer, vocab, eos)
    c = Constraint(kind="json_schema", source=json.dumps(schema(items)))
    sp = SamplingParams(max_tokens=10_000, temperature=1.0, constraint=c)
    rng = np.random.default_rng(0)
    rows = [RowLogits(sp, grammars.matcher(c), vocab, eos) for _ in range(streams)]
    for r in rows:
        r.feed(0)  # the prompt's last token
    words = np.full((streams, (vocab + 31) // 32), -1, np.int32)
    x = mx.random.normal((streams, vocab))
    mx.eval(x)
    spent = {"feed": 0.0, "mask": 0.0, "apply": 0.0}
    last: list[int | None] = [None] * streams
    for _ in range(steps):
        t = time.thread_time()
        for r, tok_id in zip(rows, last):
            if tok_id is not None:
                r.feed(tok_id)
        spent["feed"] += time.thread_time() - t
        t = time.thread_time()
        for i, r in enumerate(rows):
            r.mask_words(words[i])
        spent["mask"] += time.thread_time() - t
        t = time.thread_time()
        mx.eval(apply_words(x, words, vocab))
        spent["apply"] += time.thread_time() - t
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i in range(streams):  # a random allowed token, EOS only when it is all there is
            allowed = np.nonzero(bits[i])[0]
            if len(allowed) > 1:
                allowed = allowed[~np.isin(allowed, eos)]
            last[i] = int(rng.choice(allowed))
    out = {k: v / steps * 1000 for k, v in spent.items()}
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each kind (they alternate)")
    ap.add_argument("--tokens", type=int, default=160, help="output length the schema aims at")
    ap.add_argument("--items", type=int, default=8, help="strings in the schema's array")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    res["mask_cost_cpu_ms_per_step"] = mask_cost(args.model, args.streams, args.items)
    print(json.dumps({k: v for k, v in res.items() if k not in ("rates", "cpu_ms")}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
