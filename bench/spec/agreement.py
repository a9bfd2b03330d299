"""How far prompt lookup's matches agree with the context, and what that says
about acceptance — the evidence behind adaptive γ's agreement gate (#32).

    python -m bench.spec.agreement --model smollm2-135m [--prompts 4] [--tokens 64] [--out FILE]

The target's greedy output on each workload prompt (``bench.spec.workloads``,
mlx_lm's own decode loop, as ``bench.spec.ceiling``) is replayed token by
token through ``NgramIndex``: at every position where prompt lookup proposes
(up to γ = 6), the match's agreement (``NgramIndex.agreement``: context tokens
back from the end equal to those before the source) and whether its first
draft, and how many of its drafts, equal the output's next tokens. A gate at
agreement ``m`` withholds the rows above ``m`` until a request's own draft was
accepted (``GammaPolicy.first_match``). No timing: the replay is exact.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from engine.speculation.ngram import NgramIndex

CAP = 8  # agreements of 8 and more share a row


def tally(prompt: list[int], output: list[int], gamma: int = 6) -> dict[int, list[int]]:
    """agreement → [proposals, first draft accepted, drafts accepted] over one output."""
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    idx = NgramIndex()
    idx.extend(list(prompt))
    for i in range(len(output) - 1):
        draft = idx.propose(gamma)
        if draft and idx.source is not None:
            k = 0
            while k < len(draft) and i + k < len(output) and draft[k] == output[i + k]:
                k += 1
            row = out[min(idx.agreement(idx.source), CAP)]
            row[0] += 1
            row[1] += k > 0
            row[2] += k
        idx.extend([output[i]])
    return out


def table(results: dict[str, dict[int, list[int]]]) -> str:
    lines = [
        "| workload | agreement | proposals | first draft accepted | drafts accepted per proposal |",
        "|---|---|---|---|---|",
    ]
    for w, rows in results.items():
        for m in sorted(rows):
            n, first, acc = rows[m]
            label = f"{m}+" if m == CAP else str(m)
            lines.append(f"| {w} | {label} | {n} | {first / n:.2f} | {acc / n:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="chat,edit,copy,agent")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from mlx_lm import load

    from bench.spec.ceiling import workload_cases
    from engine.models import resolve_model

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    model, tok = load(str(resolve_model(args.model)))
    results: dict[str, dict[int, list[int]]] = {}
    for w in args.workloads.split(","):
        merged: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for _, prompt, output in workload_cases(model, tok, w, args.prompts, args.tokens):
            for m, row in tally(prompt, output).items():
                merged[m] = [a + b for a, b in zip(merged[m], row)]
        results[w] = dict(merged)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = (
        f"Command: `python -m bench.spec.agreement {' '.join(sys.argv[1:] if argv is None else argv)}` at commit "
        f"`{commit}`, model `{args.model}`, {args.prompts} prompts per workload, {args.tokens} greedy tokens, "
        f"prompt lookup at γ = 6; load {load_before:.2f} → {os.getloadavg()[0]:.2f}; "
        f"{time.perf_counter() - t0:.0f} s.\n\n" + table(results) + "\n"
    )
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
