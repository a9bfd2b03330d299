"""Prompt lookup replayed over a model's own greedy output: tokens per target call, no timing.

    python -m sims.spec_replay                  # bundled tiny, sims.bench_spec's prompts
    python -m sims.spec_replay --model DIR --tokens 160

Greedy speculation emits exactly the target's greedy tokens, so how many
tokens each target call yields with prompt lookup (``engine.ngram``) at a
fixed γ is a property of the model and the prompts alone: generate the
greedy continuation once, then replay the rounds — propose γ tokens from the
context, accept the prefix that matches the continuation, emit it plus the
target's own next token. The result matches the "tokens / target call"
column of ``sims.bench_spec`` without its minutes of noisy timing, which is
what a training run needs to compare candidate models (docs/models.md).
"""

from __future__ import annotations

import argparse

from actors.verifier import accept_window
from engine.ngram import NgramIndex


def tokens_per_call(prompt: list[int], continuation: list[int], gamma: int) -> float:
    """Tokens each target call yields with prompt lookup at ``gamma``."""
    index = NgramIndex()
    index.extend(list(prompt))
    i = calls = 0
    while i < len(continuation):
        draft = index.propose(gamma)[: len(continuation) - i - 1]  # no drafts past the end
        # the Verifier's own rule, against the target's tokens for this window
        _, emitted = accept_window(draft, continuation[i : i + len(draft) + 1])
        index.extend(emitted)
        i += len(emitted)
        calls += 1
    return len(continuation) / calls


def main(argv: list[str] | None = None) -> None:
    from engine.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args(argv)

    from mlx_lm import load

    from engine.models import resolve_model
    from engine.models.train import greedy_tokens
    from sims.bench_spec import workload_prompts

    model, tok = load(str(resolve_model(args.model)))
    prompts = workload_prompts(tok, 3)
    print(f"prompt lookup, tokens per target call ({args.model}, {args.tokens} greedy tokens, mean of 3 prompts)")
    for w in ("free", "grounded"):
        outs = [(p, greedy_tokens(model, p, args.tokens)) for p in prompts[w]]
        row = [sum(tokens_per_call(p, o, g) for p, o in outs) / len(outs) for g in range(1, 5)]
        print(f"{w:9s} " + "  ".join(f"γ={g} {v:.2f}" for g, v in enumerate(row, 1)))


if __name__ == "__main__":
    main()
