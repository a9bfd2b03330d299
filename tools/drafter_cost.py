"""What a drafter of a given shape costs against the target, before training one.

    python tools/drafter_cost.py --target /work/models/smollm2-fp32 --shapes 128x2,192x2,256x4

For each ``HIDDENxLAYERS`` it writes an untrained narrow llama with a TIED
embedding over the target's whole vocabulary (an ordinary mlx-lm directory
with the target's tokenizer files, so ``mlx_lm.server --draft-model`` could
load it too) and times a one-token step of it beside the target's forward
over n = 1..7 tokens (``bench.cpu.forward.width_leg``, one OpenBLAS thread,
300-token cache, median ms, interleaved). Weights are random: only the cost
is measured. From those it prints, per shape and γ, the per-position
acceptance a drafter of that shape needs for a target speedup (default
1.3×) with no per-round overhead:

    E(γ, a) / (V(γ+1) + γ·c) = S,   E(γ, a) = (1 − a^(γ+1)) / (1 − a)

(V: verify forward over a 1-token step, c: drafter step over a target step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def write_drafter(target: Path, out: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from engine.speculation.draft_model import narrow_llama_config

    cfg = narrow_llama_config(json.loads((target / "config.json").read_text()), hidden, layers)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out


def needed_acceptance(speedup: float, gamma: int, verify: float, c: float) -> float | None:
    """Smallest per-position acceptance a with E(γ, a) ≥ speedup·(verify + γ·c), by bisection."""
    need = speedup * (verify + gamma * c)
    if need > gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        e = sum(a**i for i in range(gamma + 1))
        lo, hi = (a, hi) if e < need else (lo, a)
    return hi


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import blas_threads, maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="smollm2-135m, gemma3-270m or an mlx-lm directory")
    ap.add_argument("--shapes", default="128x2,192x2,256x4")
    ap.add_argument(
        "--drafters",
        default="",
        help="comma-separated drafter directories (trained, small-head or mlx-lm) to time instead of --shapes",
    )
    ap.add_argument("--speedup", type=float, default=1.3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    from engine.models import resolve_model

    args.target = resolve_model(args.target)  # a name (smollm2-135m) or an mlx-lm directory

    from mlx_lm import load
    from mlx_lm.utils import load_model

    from bench.cpu.forward import load_with_ids, width_leg

    model, _, ids = load_with_ids(str(args.target))
    del model
    blas_threads().use(1)
    tmp = Path(tempfile.mkdtemp(prefix="drafter-cost-"))
    rows = []
    from engine.mlx.draft_model import MlxDraftModel

    items = args.drafters.split(",") if args.drafters else args.shapes.split(",")
    for shape in items:
        if args.drafters:  # a real drafter directory, loaded as the engine loads it
            drafter = MlxDraftModel(shape).model
            cfg = json.loads((Path(shape) / "config.json").read_text())
            hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        else:
            hidden, layers = (int(x) for x in shape.split("x"))
            drafter = load_model(write_drafter(args.target, tmp / shape, hidden, layers))[0]
        target, _ = load(str(args.target))
        width = width_leg(target, ids, args.rounds, args.steps, 7)
        draft = width_leg(drafter, ids, args.rounds, args.steps, 1)[1]
        width2 = width_leg(target, ids, args.rounds, args.steps, 1)  # the target again, after: load drift
        step = (width[1] + width2[1]) / 2
        c = draft / step
        params = hidden * 49152 + layers * (4 * hidden * hidden + 3 * hidden * 3 * hidden)
        need = {g: needed_acceptance(args.speedup, g, width[g + 1] / width[1], c) for g in range(1, 7)}
        rows.append((shape, params, step, draft, c, {n: ms / width[1] for n, ms in width.items()}, need))
        print(
            f"{shape}: {params / 1e6:.1f}M params, target step {step:.1f} ms, drafter step {draft:.2f} ms "
            f"(c = {c:.3f}); verify n=2..7: "
            + ", ".join(f"{width[n] / width[1]:.2f}" for n in range(2, 8))
            + f"; acceptance needed for {args.speedup}×: "
            + ", ".join(f"γ={g} {'–' if a is None else f'{a:.2f}'}" for g, a in need.items()),
            flush=True,
        )
    shutil.rmtree(tmp, ignore_errors=True)
    json.dump([r[:5] + (r[5], r[6]) for r in rows], sys.stdout)
    print()


if __name__ == "__main__":
    main()
