"""Which weight format to serve a real model in on this CPU: speed beside quality (issue #41).

    python -m bench.cpu.weight_format --model qwen2.5-coder-1.5b
    python -m bench.cpu.weight_format --model qwen2.5-coder-0.5b --formats float32,q8,q4 --rounds 1

The model's GGUF is dequantized once to float32 (``resolve_model`` of the packaged name with
``EMBER_WEIGHTS=float32``); every other format is made from those float32 weights in the process,
the way ``ember convert --dtype`` writes it: ``bfloat16``/``float16`` by ``set_dtype``, ``q8``/``q4``
by ``nn.quantize`` (MLX affine, group 64, what ``mlx_lm.convert -q`` writes); ``q8dot`` is ``q8`` with
decode-sized calls on the kernel's integer dot path (``ember serve``'s default for 8-bit weights where the
CPU has AVX-512 VNNI), ``q8`` then the exact kernel (``--no-qmm-dot``). Each format is run as
``ember serve`` runs it: MLX's CPU kernels plus, where Ember installs one for that format, its own
(``engine.mlx.qmm_linear`` for q8/q4, ``engine.mlx.fmm_linear`` for float32; ``--no-ember-kernels`` measures MLX alone).

Per format:
* **decode**: tok/s of a greedy decode of ``--tokens`` steps after a short prompt (median over rounds,
  the formats' order rotating round by round), cut at ``--budget-s`` (then the rate of the steps done);
* **prefill**: tok/s of one forward over ``--prefill`` tokens of a fixed code text;
* **quality** against float32 on the same fixed text: top-1 agreement of the next-token argmax at
  every position (teacher forced, ``--tf-chunk`` tokens a forward: the calls a decode or verify step
  makes, where ``q8dot`` differs from ``q8``), perplexity, and the greedy continuation's agreement (tokens equal
  to float32's before the first difference, out of ``--tokens``);
* weight bytes read per token and the fraction of the memory-bandwidth floor that decode reaches
  (bandwidth measured here over ``--bandwidth-mib``, a slice a core at once, by the faster of a
  numpy sum and plain loads).

``--out FILE`` writes the markdown table with the command, commit and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from typing import Any

FORMATS = ("float32", "bfloat16", "float16", "q8", "q8dot", "q4")
# q8dot: the q8 weights with decode-sized calls on the kernel's integer dot path
# (x rounded to int16 a group; engine.mlx.qmm_kernel.qmm_t_dot); q8 is then the
# exact kernel, mlx-lm's bits
QUANTIZED = {"q8": 8, "q8dot": 8, "q4": 4}

# A fixed code text (no file of the machine: the same bytes everywhere).
TEXT = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class Task:
    """One unit of work in the queue."""

    name: str
    priority: int = 0
    tags: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "priority": self.priority, "tags": self.tags})


class TaskQueue:
    """A priority queue of tasks, persisted to a JSON file."""

    def __init__(self, path: str):
        self.path = path
        self.tasks: list[Task] = []
        if os.path.exists(path):
            with open(path) as f:
                for item in json.load(f):
                    self.tasks.append(Task(**item))

    def push(self, task: Task) -> None:
        self.tasks.append(task)
        self.tasks.sort(key=lambda t: -t.priority)

    def pop(self) -> Task | None:
        if not self.tasks:
            return None
        return self.tasks.pop(0)

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump([json.loads(t.to_json()) for t in self.tasks], f, indent=2)


def main() -> None:
    queue = TaskQueue("tasks.json")
    queue.push(Task("write tests", priority=2, tags=["dev"]))
    queue.push(Task("fix bug", priority=5))
    while (task := queue.pop()) is not None:
        print(f"running {task.name}")
    queue.save()


if __name__ == "__main__":
    main()
'''
PROMPT = "def quicksort(items):\n    "


def _load_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def _make(base_path: str, fmt: str, kernels: bool) -> Any:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, _ = load(base_path)
    if fmt in QUANTIZED:
        nn.quantize(
            model,
            group_size=64,
            bits=QUANTIZED[fmt],
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
    elif fmt != "float32":
        model.set_dtype(getattr(mx, fmt))
    mx.eval(model.parameters())
    if kernels and fmt in QUANTIZED:
        from engine.mlx import qmm_linear

        qmm_linear.install(model, dot=fmt == "q8dot")  # what read_model does on MLX's CPU backend
    elif kernels and fmt == "float32":
        from engine.mlx import fmm_linear

        fmm_linear.install(model)  # so does the float32 kernel (decode-sized calls)
    return model


def _weight_bytes(model: Any) -> tuple[int, int]:
    """The model's weight bytes, and those a decode step reads: all but an
    untied input embedding (a model with its own ``lm_head`` reads one row of
    ``embed_tokens`` a token; a tied one reads it whole, as the head)."""
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())
    total = sum(int(v.nbytes) for _, v in flat)
    untied = any(".lm_head." in f".{k}." for k, _ in flat)
    embedding = sum(int(v.nbytes) for k, v in flat if ".embed_tokens." in f".{k}.") if untied else 0
    return total, total - embedding


def _decode(model: Any, prompt: list[int], tokens: int, budget_s: float) -> tuple[float, list[int]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out: list[int] = []
    t0 = t_first = time.perf_counter()
    for (tok, _), _i in zip(generate_step(mx.array(prompt), model, max_tokens=tokens), range(tokens)):
        out.append(int(tok))
        if len(out) == 1:
            t_first = time.perf_counter()  # the prompt's prefill is not decode
        if time.perf_counter() - t0 > budget_s:
            break
    steps = len(out) - 1
    rate = steps / (time.perf_counter() - t_first) if steps > 0 else 0.0
    return rate, out


def _prefill(model: Any, ids: list[int]) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    mx.eval(model(mx.array([ids]), cache=cache))
    return len(ids) / (time.perf_counter() - t0)


def _teacher_forced(model: Any, ids: list[int], chunk: int) -> tuple[Any, float]:
    """Next-token argmax at every position and the perplexity, the text fed
    ``chunk`` tokens a forward through a KV cache (0: one forward), so that
    the calls are the size a decode or a verify step makes, not a prefill's."""
    import math

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    inp = ids[:-1]
    if chunk <= 0:
        logits = model(mx.array([inp])).astype(mx.float32)[0]
    else:
        cache = make_prompt_cache(model)
        parts = []
        for i in range(0, len(inp), chunk):
            part = model(mx.array([inp[i : i + chunk]]), cache=cache).astype(mx.float32)[0]
            mx.eval(part)
            parts.append(part)
        logits = mx.concatenate(parts, axis=0)
    ppl = math.exp(float(nn.losses.cross_entropy(logits, mx.array(ids[1:])).mean().item()))  # type: ignore[arg-type]
    return mx.argmax(logits, axis=-1), ppl


def bandwidth_gbs(mib: int) -> tuple[float, str]:
    """The best of 5 reads of ``mib`` MiB, one slice a core at once, by the
    faster of two readers: numpy's sum and the kernel library's plain loads
    (``stream_read``; both release the GIL). Decode reads its weights on
    every core, and one core alone streams about half of what two do on some
    hosts here (12.3 against ~25 GB/s), which had put a step over 100% of its
    "floor"; a numpy sum adds floats as it reads and read ~24 GB/s where plain
    loads read ~30, which had put the floor too low. Returns (GB/s, reader)."""
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    import numpy as np

    from engine.mlx import qmm_kernel

    n = max(1, os.cpu_count() or 1)
    a = np.ones(mib << 18, dtype=np.float32)  # mib MiB
    parts = np.array_split(a, n)
    readers: dict[str, Any] = {"numpy sum": np.sum}
    lib = qmm_kernel.load()
    if lib is not None:
        readers["plain loads"] = partial(qmm_kernel.stream_read, lib)
    best, which = 0.0, ""
    with ThreadPoolExecutor(n) as pool:
        for name, read in readers.items():
            list(pool.map(read, parts))
            for _ in range(5):
                t0 = time.perf_counter()
                list(pool.map(read, parts))
                gbs = a.nbytes / (time.perf_counter() - t0) / 1e9
                if gbs > best:
                    best, which = gbs, name
    return best, which


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.weight_format", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=60.0, help="a decode leg stops after this long")
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument(
        "--tf-chunk",
        type=int,
        default=8,
        help="teacher-forced quality feeds the text this many tokens a forward (decode- and verify-sized calls, "
        "the ones q8dot changes); 0: one forward (a prefill)",
    )
    ap.add_argument("--no-ember-kernels", action="store_true", help="MLX's own kernels only")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)

    os.environ["EMBER_WEIGHTS"] = "float32"
    import mlx.core as mx
    from mlx_lm import load

    from engine.models import resolve_model

    base = str(resolve_model(args.model))
    _, tok = load(base)
    text_ids = tok.encode(TEXT)
    prefill_ids = (text_ids * (args.prefill // len(text_ids) + 1))[: args.prefill]
    prompt = tok.encode(PROMPT)
    formats = [f for f in args.formats.split(",") if f]
    load_before = _load_load()
    bw, reader = bandwidth_gbs(args.bandwidth_mib)

    # quality first, one model at a time (float32's references kept as arrays)
    ref_model = _make(base, "float32", False)
    ref_argmax, ref_ppl = _teacher_forced(ref_model, text_ids, args.tf_chunk)
    _, ref_greedy = _decode(ref_model, prompt, args.tokens, 1e9)
    mx.eval(ref_argmax)
    del ref_model

    rows: dict[str, dict[str, Any]] = {f: {"decode": [], "prefill": []} for f in formats}
    for r in range(args.rounds):
        order = formats[r % len(formats) :] + formats[: r % len(formats)]
        for fmt in order:
            model = _make(base, fmt, not args.no_ember_kernels)
            row = rows[fmt]
            if r == 0:
                row["bytes"], row["read"] = _weight_bytes(model)
                argmax, ppl = _teacher_forced(model, text_ids, args.tf_chunk)
                row["agree"] = float(mx.mean(argmax == ref_argmax).item())  # type: ignore[arg-type]
                row["ppl"] = ppl
            rate, greedy = _decode(model, prompt, args.tokens, args.budget_s)
            row["decode"].append(rate)
            if r == 0:
                same = 0
                for a, b in zip(greedy, ref_greedy):
                    if a != b:
                        break
                    same += 1
                row["greedy_same"] = f"{same}/{len(greedy)}"
            row["prefill"].append(_prefill(model, prefill_ids))
            print(f"[weight_format] round {r + 1} {fmt}: decode {rate:.2f} tok/s", flush=True)
            del model
            mx.clear_cache()

    f32 = statistics.median(rows["float32"]["decode"]) if "float32" in rows else None
    lines = [
        f"Command: `python -m bench.cpu.weight_format --model {args.model} --formats {args.formats} "
        f"--tokens {args.tokens} --prefill {args.prefill} --rounds {args.rounds} --tf-chunk {args.tf_chunk}`",
        "",
        f"Commit {_commit()}; load (1/5 min) {load_before} before, {_load_load()} after; "
        f"memory bandwidth measured {bw:.1f} GB/s ({reader}, every core at once); {os.cpu_count()} cores; "
        f"Ember's kernels {'off' if args.no_ember_kernels else 'on where installed'}.",
        "",
        "| format | weights GB | read a token GB | decode tok/s | x float32 | % of bandwidth floor | prefill tok/s "
        "| top-1 agreement with float32 | perplexity | greedy tokens = float32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt in formats:
        row = rows[fmt]
        dec = statistics.median(row["decode"])
        floor = bw * 1e9 / row["read"]  # tokens a second if a step took only its reads
        lines.append(
            f"| {fmt} | {row['bytes'] / 1e9:.2f} | {row['read'] / 1e9:.2f} | {dec:.2f} | {dec / f32:.2f}x | {100 * dec / floor:.0f}% "
            f"| {statistics.median(row['prefill']):.1f} | {100 * row['agree']:.1f}% | {row['ppl']:.3f} "
            f"| {row['greedy_same']} |"
            if f32
            else f"| {fmt} | {row['bytes'] / 1e9:.2f} | {row['read'] / 1e9:.2f} | {dec:.2f} | | | | | | |"
        )
    lines.append("")
    lines.append(f"float32 perplexity on the fixed text: {ref_ppl:.3f}.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
