"""Decode throughput with LoRA adapters (issue #43): one continuous batch of
base rows only, then the same batch with adapters loaded and the rows split
between the base model and two adapters (``engine.mlx.lora``: each row its
own delta in one forward), on the MLX backend with hand-written plans.

    python -m bench.lora --model tiny --rows 8 --steps 48 --repeat 3

Prints tok/s for: no adapters loaded; adapters loaded, every row base; every
row one adapter; mixes (one/two; base/one/two). Each mix is run two ways (the
issue's "share the batch or group, whichever measures faster"): every row in
one batch with its per-row delta, and grouped, each adapter's rows their own
batch (one forward per group per round); their greedy tokens must agree. Last,
the cost of an adapter row against a base row (all-adapter / all-base tok/s). The adapters are random
(``random_adapter``: mlx-lm's own LoRA layers, rank 4, on q/v/down, B
non-zero), so their tokens differ from the base model's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def random_adapter(model_path: pathlib.Path, out: pathlib.Path, *, seed: int, num_layers: int = 4) -> pathlib.Path:
    """mlx-lm's own LoRA layers on a fresh load of the model, B drawn non-zero
    (a trained adapter's; mlx-lm starts B at zero, which would change nothing),
    saved as ``mlx_lm.lora`` saves them (the trainable parameters), with its config."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_path))
    model.freeze()
    params = {"rank": 4, "scale": 8.0, "dropout": 0.0, "keys": KEYS}
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    for _, m in model.named_modules():
        if type(m).__name__ == "LoRALinear":
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _decode(backend, device, adapters: list[str], prompt: list[int], steps: int) -> tuple[float, list[list[int]]]:
    """Decode ``steps`` greedy tokens for every row in ONE continuous batch (each
    row its adapter's delta): the seconds of the timed steps and each row's tokens."""
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
    from engine.types import SamplingParams

    greedy = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    rids = list(range(len(adapters)))
    device.call(backend.step, StepPlan(open=[OpenRow(r, greedy, adapter=a) for r, a in zip(rids, adapters)]))
    device.call(backend.step, StepPlan(prefill=[PrefillChunk(r, prompt[:-1]) for r in rids]))
    nxt = dict.fromkeys(rids, prompt[-1])
    out: dict[int, list[int]] = {r: [] for r in rids}
    for i in range(steps + 4):
        if i == 4:  # the first steps join the rows into the batch
            t0 = time.perf_counter()
        res = device.call(backend.step, StepPlan(decode=[DecodeRow(r, nxt[r]) for r in rids]))
        nxt = {r: res.tokens[r] for r in rids}
        for r in rids:
            out[r].append(nxt[r])
    dt = time.perf_counter() - t0
    device.call(backend.step, StepPlan(close=rids))
    return dt, [out[r] for r in rids]


def per_row(backend, device, adapters: list[str], prompt: list[int], steps: int) -> tuple[float, list[list[int]]]:
    """Every row in one batch, a per-row LoRA delta: tok/s and each row's tokens."""
    dt, tokens = _decode(backend, device, adapters, prompt, steps)
    return steps * len(adapters) / dt, tokens


def grouped(backend, device, adapters: list[str], prompt: list[int], steps: int) -> tuple[float, list[list[int]]]:
    """The same rows grouped by adapter, each group its own batch: one forward per
    group per decode round, as a scheduler grouping rows by adapter would run.

    The backend holds one decode batch (a row of it not decoded in a step is
    padded into the forward, not left out), so the groups run one after the
    other over the same steps: the same forwards, at each group's own width, as
    interleaving them per round. tok/s over all rows' tokens and the summed time."""
    total = 0.0
    tokens: list[list[int]] = [[] for _ in adapters]
    for name in dict.fromkeys(adapters):  # first-seen order
        idx = [i for i, a in enumerate(adapters) if a == name]
        dt, toks = _decode(backend, device, [name] * len(idx), prompt, steps)
        total += dt
        for i, t in zip(idx, toks):
            tokens[i] = t
    return steps * len(adapters) / total, tokens


def _load(config: Any) -> tuple[Any, Any]:
    """The MLX backend of ``config`` and its thread (through the assembler, which alone builds backends)."""
    from ember.assemble import load_ports

    ports = load_ports(config)
    return ports.backend, ports.device


def main() -> None:
    from engine.adapters import read_adapter
    from engine.config import EngineConfig
    from engine.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3, help="rounds over the cases; the best of each is printed")
    args = p.parse_args()
    path = resolve_model(args.model)
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    with tempfile.TemporaryDirectory() as tmp:
        specs = tuple(
            read_adapter(n, str(random_adapter(path, pathlib.Path(tmp) / n, seed=s)))
            for n, s in (("one", 1), ("two", 2))
        )
        plain, lora = (_load(EngineConfig(model=str(path), adapters=a)) for a in ((), specs))
        prompt = plain[0].tokenizer.encode(text)
        one, two = (s.id for s in specs)
        cases = {
            "no adapters loaded": (plain, [""] * args.rows),
            "adapters loaded, base rows": (lora, [""] * args.rows),
            "every row adapter one": (lora, [one] * args.rows),
            "mix one/two": (lora, [(one, two)[i % 2] for i in range(args.rows)]),
            "mix base/one/two": (lora, [("", one, two)[i % 3] for i in range(args.rows)]),
        }
        mixed = [n for n, (_, rows) in cases.items() if len(set(rows)) > 1]
        results: dict[str, float] = dict.fromkeys(cases, 0.0)
        grouped_tps: dict[str, float] = dict.fromkeys(mixed, 0.0)
        try:
            for _ in range(args.repeat):  # interleaved, best of: a shared machine's noise is one-sided
                for name, ((backend, device), rows) in cases.items():
                    tps, tokens = per_row(backend, device, rows, prompt, args.steps)
                    results[name] = max(results[name], tps)
                    if name in mixed:
                        gtps, gtokens = grouped(backend, device, rows, prompt, args.steps)
                        grouped_tps[name] = max(grouped_tps[name], gtps)
                        # the same greedy tokens either way: a mismatch is a bug in the per-row delta
                        assert gtokens == tokens, f"{name}: grouped tokens differ from the per-row batch's"
        finally:
            plain[1].close()
            lora[1].close()
    print(f"{args.model}, {args.rows} rows, {args.steps} decode steps, best of {args.repeat}")
    print(f"  {'case':28s} {'per-row delta':>14s} {'grouped':>10s} {'grouped/per-row':>16s}")
    for name, tps in results.items():
        if name in grouped_tps:
            g = grouped_tps[name]
            print(f"  {name:28s} {tps:8.1f} tok/s {g:10.1f} {g / tps:15.2f}x")
        else:
            print(f"  {name:28s} {tps:8.1f} tok/s {'(one batch)':>10s}")
    base, adapted = results["adapters loaded, base rows"], results["every row adapter one"]
    print(f"  adapter row vs base row (all-adapter / all-base, {args.rows} rows): {adapted / base:.2f}x tok/s")
    for name, g in grouped_tps.items():
        faster = "grouped" if g > results[name] else "per-row delta"
        print(f"  {name}: {faster} is faster as measured")


if __name__ == "__main__":
    main()
