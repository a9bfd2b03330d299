"""Prompt lookup replayed over a model's own greedy output: tokens per target call, no timing.

    python -m bench.spec.replay                  # bundled tiny, bench.spec.sweep's prompts
    python -m bench.spec.replay --model DIR --tokens 160

Greedy speculation emits exactly the target's greedy tokens, so how many
tokens each target call yields with prompt lookup (``engine.speculation.ngram``) at a
fixed γ is a property of the model and the prompts alone: generate the
greedy continuation once, then replay the rounds — propose γ tokens from the
context, accept the prefix that matches the continuation, emit it plus the
target's own next token. The result matches the "tokens / target call"
column of ``bench.spec.sweep`` without its minutes of noisy timing, which is
what a training run needs to compare candidate models (docs/models.md).
"""

from __future__ import annotations

import argparse

from bench.spec.ceiling import NgramDrafter, greedy, replay


def tokens_per_call(prompt: list[int], continuation: list[int], gamma: int) -> float:
    """Tokens each target call yields with prompt lookup at ``gamma`` (``bench.spec.ceiling.replay``)."""
    return replay(continuation, gamma, NgramDrafter(prompt)).tokens_per_call


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args(argv)

    from mlx_lm import load

    from bench.spec.sweep import workload_prompts
    from engine.models import resolve_model

    model, tok = load(str(resolve_model(args.model)))
    prompts = workload_prompts(tok, 3)
    print(f"prompt lookup, tokens per target call ({args.model}, {args.tokens} greedy tokens, mean of 3 prompts)")
    for w in ("free", "grounded"):
        outs = [(p, greedy(model, p, args.tokens)) for p in prompts[w]]  # EOS ignored
        row = [sum(tokens_per_call(p, o, g) for p, o in outs) / len(outs) for g in range(1, 5)]
        print(f"{w:9s} " + "  ".join(f"γ={g} {v:.2f}" for g, v in enumerate(row, 1)))


if __name__ == "__main__":
    main()
