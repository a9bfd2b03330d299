"""How far is prompt lookup from the best any copy drafter could do? Tokens per target call.

    python -m bench.spec.ceiling --model /work/models/smollm2-fp32 --workloads edit --gammas 4,6 --tokens 48
    python -m bench.spec.ceiling --model DIR --workloads edit,copy,agent --verify-costs 1.59,1.71

Greedy speculation emits exactly the target's greedy tokens, so the target's
greedy output on each workload prompt (``bench.spec.workloads``) can be
replayed through a drafter in a simulated speculative loop: each round drafts
at most γ tokens, accepts the prefix that matches the output and adds the
target's own next token. Three drafters, on the same output:

- **ngram**: prompt lookup as Ember has it (``engine.speculation.ngram.NgramIndex``;
  **ngram-recent**: the same with ``forward`` off, the most recent occurrence
  only, as it was before issue #21's fourth pass);
- **aligner**: the ideal aligner, difflib's alignment of the output tokens to
  the prompt tokens; inside a matching block it proposes the aligned source
  continuation, elsewhere nothing (what a lookup that never loses its place in
  the source could do);
- **oracle**: knows the future output and drafts from whichever context
  position continues it furthest (a copy may run into the tokens it copies, as
  a repetition does): the ceiling of any drafter that copies from the context.

If the aligner is far above ngram, the lookup is the problem; if the aligner
is close to ngram and both are far below γ + 1, the model departs from the
input. ``--verify-costs`` (one per γ: a verify round's cost in plain decode
rounds, measured by ``bench.spec.sweep``) turns tokens per call into the speedup
each drafter could reach at most. No timing here: the replay is exact and
the model runs only to produce the greedy outputs.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.speculation.ngram import NgramIndex


class Drafter(Protocol):
    """One request's drafter in the replay: proposes, then sees what was emitted."""

    def propose(self, k: int) -> list[int]: ...

    def accepted(self, tokens: list[int]) -> None: ...


@dataclass(frozen=True)
class Replay:
    tokens_per_call: float
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        return self.accepted / max(1, self.drafted)


def replay(output: Sequence[int], gamma: int, drafter: Drafter) -> Replay:
    """The speculative loop over a known output: each target call verifies a
    draft of at most ``gamma`` tokens (none past the output's end), emits the
    matching prefix plus the target's own next token."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    i = calls = drafted = accepted = 0
    while i < len(output):
        draft = drafter.propose(min(gamma, len(output) - i - 1))
        k = 0
        while k < len(draft) and i + k < len(output) and draft[k] == output[i + k]:
            k += 1
        drafted += len(draft)
        accepted += k
        emitted = list(output[i : i + k + 1])
        drafter.accepted(emitted)
        i += len(emitted)
        calls += 1
    return Replay(len(output) / max(1, calls), drafted, accepted)


class NgramDrafter:
    """Ember's prompt lookup, with the sizes the ngram drafter core uses by default."""

    def __init__(self, prompt: Sequence[int], *, min_n: int = 2, max_n: int = 4, forward: bool = True):
        self.index = NgramIndex(min_n=min_n, max_n=max_n)
        self.index.forward = forward
        self.index.extend(list(prompt))

    def propose(self, k: int) -> list[int]:
        return self.index.propose(k) if k > 0 else []

    def accepted(self, tokens: list[int]) -> None:
        self.index.extend(list(tokens))


class AlignerDrafter:
    """The ideal aligner: at output position ``i`` inside one of difflib's
    matching blocks (output ``i`` aligned to prompt ``a``) it proposes
    ``prompt[a:a+k]``; outside a block, nothing."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int]):
        self.prompt = list(prompt)
        sm = difflib.SequenceMatcher(None, self.prompt, list(output), autojunk=False)
        self.blocks = [b for b in sm.get_matching_blocks() if b.size]
        self.source = {b.b + t: b.a + t for b in self.blocks for t in range(b.size)}
        self.i = 0

    @property
    def covered(self) -> int:
        """Output tokens inside a matching block."""
        return len(self.source)

    def propose(self, k: int) -> list[int]:
        a = self.source.get(self.i)
        return [] if a is None or k <= 0 else self.prompt[a : a + k]

    def accepted(self, tokens: list[int]) -> None:
        self.i += len(tokens)


class OracleDrafter:
    """Knows the output: drafts from the context position whose continuation
    matches the output's next tokens longest. The context is the prompt and
    the output so far; a copy starting near the end runs on into the tokens
    it has just copied (a repetition), as prompt lookup's does."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int]):
        self.seq = list(prompt) + list(output)
        self.at = len(prompt)  # where the next output token stands in seq

    def propose(self, k: int) -> list[int]:
        seq, at = self.seq, self.at
        k = min(k, len(seq) - at)
        best = 0
        for j in range(at):
            m = 0
            while m < k and seq[j + m] == seq[at + m]:
                m += 1
            if m > best:
                best = m
                if m == k:
                    break
        return seq[at : at + best]

    def accepted(self, tokens: list[int]) -> None:
        self.at += len(tokens)


DRAFTERS: dict[str, Callable[[Sequence[int], Sequence[int]], Drafter]] = {
    # the lookup before spec4's fix (most recent occurrence only): the "ngram before" column
    "ngram-recent": lambda prompt, output: NgramDrafter(prompt, forward=False),
    "ngram": lambda prompt, output: NgramDrafter(prompt),
    "aligner": AlignerDrafter,
    "oracle": OracleDrafter,
}


def ceilings(prompt: Sequence[int], output: Sequence[int], gamma: int) -> dict[str, Replay]:
    """Each drafter's replay of one (prompt, output) pair at ``gamma``."""
    return {name: replay(output, gamma, make(prompt, output)) for name, make in DRAFTERS.items()}


def report(
    cases: list[tuple[str, list[int], list[int]]],
    gammas: list[int],
    verify_costs: list[float] | None = None,
) -> str:
    """One row per (case, γ): tokens per call for each drafter (ngram's
    acceptance in brackets), then the mean over the cases per workload and
    γ; with ``verify_costs`` (one per γ) each row's and each mean's speedup
    ceiling (tokens per call ÷ the verify round's cost), in the same order."""
    names = list(DRAFTERS)
    lines = [
        f"{'case':12} {'γ':>2} {'tokens':>6}  " + "  ".join(f"{n:>12}" for n in names) + "  (tokens per target call)"
    ]
    means: dict[tuple[str, int], list[dict[str, float]]] = {}
    for key, prompt, output in cases:
        for g in gammas:
            r = ceilings(prompt, output, g)
            cells = []
            for n in names:
                cell = f"{r[n].tokens_per_call:.2f}"
                if n == "ngram":
                    cell += f" ({r[n].acceptance:.0%})" if r[n].drafted else " (none)"
                cells.append(f"{cell:>12}")
            line = f"{key:12} {g:>2} {len(output):>6}  " + "  ".join(cells)
            if verify_costs:
                cost = verify_costs[gammas.index(g)]
                line += "  ÷ " + f"{cost:.2f}: " + " ".join(f"{r[n].tokens_per_call / cost:.2f}×" for n in names)
            lines.append(line)
            workload = key.rstrip("0123456789.")
            means.setdefault((workload, g), []).append({n: r[n].tokens_per_call for n in names})
    lines.append("")
    lines.append("mean per workload" + (" (speedup ceiling = tokens per call ÷ verify cost)" if verify_costs else ""))
    for (workload, g), rows in means.items():
        mean = {n: sum(row[n] for row in rows) / len(rows) for n in names}
        joined = "  ".join(f"{n} {mean[n]:.2f}" for n in names)
        line = f"{workload:8} γ={g}: {joined}  ({len(rows)} outputs)"
        if verify_costs:
            cost = verify_costs[gammas.index(g)]
            line += f"; at verify cost {cost:.2f}: " + "  ".join(f"{n} {mean[n] / cost:.2f}×" for n in names)
        lines.append(line)
    return "\n".join(lines)


# --- the model: greedy outputs of the workloads (mlx_lm's own decode loop) ---


def greedy(model: Any, prompt: list[int], n: int, eos: Collection[int] = ()) -> list[int]:
    """Up to ``n`` greedy tokens after ``prompt`` (mlx-lm's own decode loop), stopping after one in ``eos``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    ids: list[int] = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0)):
        ids.append(int(t))
        if ids[-1] in eos:
            break
    return ids


def workload_cases(
    model: Any, tokenizer: Any, workload: str, n: int, tokens: int
) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt, greedy output) for the first ``n`` prompts of a workload;
    an agent session gives one case per turn, each turn built from the model's
    own earlier answers (as ``bench.spec.sweep`` runs it)."""
    from bench.spec import workloads as sw

    cases: list[tuple[str, list[int], list[int]]] = []
    if workload == "agent":
        for i, s in enumerate(sw.agent_sessions(n)):
            for t in range(s.TURNS):
                prompt = s.next_prompt(tokenizer)
                out = greedy(model, prompt, tokens, tokenizer.eos_token_ids)
                s.answered(tokenizer.decode(out))
                cases.append((f"agent{i}.{t}", prompt, out))
        return cases
    make = {"chat": sw.chat_prompts, "edit": sw.edit_prompts, "copy": sw.copy_prompts}[workload]
    for i, prompt in enumerate(make(tokenizer, n)):
        cases.append((f"{workload}{i}", prompt, greedy(model, prompt, tokens, tokenizer.eos_token_ids)))
    return cases


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="model directory or name (engine.models.resolve_model)")
    ap.add_argument("--workloads", default="edit,copy,agent", help="comma-separated: chat, edit, copy, agent")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (agent: sessions) per workload")
    ap.add_argument("--gammas", default="4,6", help="comma-separated draft lengths")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per output (fewer after EOS)")
    ap.add_argument(
        "--verify-costs",
        default=None,
        help="comma-separated, one per γ: a verify round's cost in plain rounds (e.g. 1.59,1.71)",
    )
    args = ap.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",") if g.strip()]
    if not gammas or min(gammas) < 1:
        ap.error(f"--gammas: need draft lengths >= 1, got {args.gammas!r}")
    if args.tokens < 1 or args.prompts < 1:
        ap.error("--tokens and --prompts must be >= 1")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in ("chat", "edit", "copy", "agent"):
            ap.error(f"--workloads: unknown workload {w!r} (chat, edit, copy, agent)")
    costs = _floats(args.verify_costs) if args.verify_costs else None
    if costs is not None and len(costs) != len(gammas):
        ap.error(f"--verify-costs: need one cost per γ ({len(gammas)}), got {len(costs)}")

    from mlx_lm import load

    from engine.mlx.tokenizer import MLXTokenizer
    from engine.models import resolve_model

    model, tok = load(str(resolve_model(args.model)))
    tokenizer = MLXTokenizer(tok)  # Ember's tokenizer builds the prompts, as the engine would
    cases = [c for w in workloads for c in workload_cases(model, tokenizer, w, args.prompts, args.tokens)]
    print(f"{args.model}: greedy outputs of {args.tokens} tokens replayed (γ = {args.gammas})")
    print(report(cases, gammas, costs))


if __name__ == "__main__":
    main()
