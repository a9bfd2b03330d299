"""Suffix decoding's drafts as paths against trees, verified on the real model.

    python -m bench.spec.tree --model smollm2-135m
    python -m bench.spec.tree --model qwen2.5-coder-1.5b --arms path:8,tree:8,path:16,tree:16 --rounds 2

Issue #42 asks to verify a draft *tree* in one forward if it pays, and to
measure paths against trees. This runs the same requests, greedy, at batch
1, through one decode loop with four kinds of step, in one process on the
engine's own load of the model (its weight format and CPU kernels):

* ``plain``: one token a forward;
* ``path:K``: suffix decoding's draft (``SuffixIndex.propose``, the request's
  own text and its session's store, the better score), at most K tokens,
  verified as one window; the cache trimmed past the accepted prefix;
* ``tree:K``: suffix decoding's draft tree (``propose_tree``), at most K
  nodes, verified in one forward with a tree mask (``engine.mlx.tree_verify``);
  the accepted branch's K/V kept, the rest dropped.

Each arm keeps its own suffix store, fresh each round, and learns every
request it finished (the engine's ``learn``), so an agent session's later
turns draft from its earlier ones, as in the server. The workloads are
``bench.spec.workloads``' agent session (turns built from plain decode's
answers, so every arm sees the same prompts) and chat prompts (their own
store: nothing repeats there).

Speedup is an arm's decode tok/s over plain's on the same request in the
same round (prefill excluded), geometric mean over requests and rounds.
``identical``: requests whose tokens equalled plain's. ``call ÷ step``: an
arm's time per target forward over plain's time per token, what a window
costs. This loop is not the engine's (no batching, no adaptive γ, no
actors): it measures the verify shapes against each other, not the server.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.speculation.suffix import NO_TREE, DraftTree, SuffixIndex, SuffixParams, SuffixStore

PREFILL_CHUNK = 512


@dataclass
class Run:
    """One request through one arm."""

    tokens: list[int]
    seconds: float
    calls: int
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0


@dataclass
class ArmStats:
    speedups: list[float] = field(default_factory=list)
    identical: int = 0
    requests: int = 0
    tokens: int = 0
    calls: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0

    def add(self, run: Run, plain: Run) -> None:
        self.requests += 1
        self.identical += run.tokens == plain.tokens
        self.tokens += len(run.tokens)
        self.calls += run.calls
        self.seconds += run.seconds
        self.drafted += run.drafted
        self.accepted += run.accepted
        self.draft_s += run.draft_s
        if run.seconds > 0 and plain.seconds > 0:
            self.speedups.append((len(run.tokens) / run.seconds) / (len(plain.tokens) / plain.seconds))


def _argmax(logits: mx.array) -> list[int]:
    return [int(t) for t in np.asarray(mx.argmax(logits[0], axis=-1))]


def _prefill(model: Any, prompt: list[int], cache: list[Any] | None = None) -> list[Any]:
    """The prompt but its last token in a fresh cache; with ``cache`` (one
    already prefilled with it), a copy of that: every arm decodes from the
    same prefill, computed once a request."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.mlx.blas import blas_threads

    fresh = make_prompt_cache(model)
    if cache is not None:
        for mine, theirs in zip(fresh, cache):
            keys, values, offset = theirs.state  # the same arrays: copies, so one arm's writes stay its own
            mine.state = (mx.array(keys), mx.array(values), offset)
        return fresh
    cache = fresh
    body = prompt[:-1]
    blas_threads().use(0)  # prefill is a real GEMM: every thread
    for i in range(0, len(body), PREFILL_CHUNK):
        model(mx.array([body[i : i + PREFILL_CHUNK]]), cache=cache)
        mx.eval([(c.keys, c.values) for c in cache])
    blas_threads().use(1)  # a batch-1 step, as the engine runs it
    return cache


def _finish(out: list[int], n: int, eos: set[int]) -> list[int]:
    out = out[:n]
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


def plain(model: Any, prompt: list[int], n: int, eos: set[int], prefilled: list[Any] | None = None) -> Run:
    cache = _prefill(model, prompt, prefilled)
    y, out = prompt[-1], list[int]()
    t0 = time.perf_counter()
    while len(out) < n and not (out and out[-1] in eos):
        y = _argmax(model(mx.array([[y]]), cache=cache)[:, -1:])[0]
        out.append(y)
    return Run(tokens=out, seconds=time.perf_counter() - t0, calls=len(out))


Proposer = Callable[[list[int], int], DraftTree]


def speculative(
    model: Any,
    prompt: list[int],
    n: int,
    eos: set[int],
    propose: Proposer,
    budget: int,
    prefilled: list[Any] | None = None,
) -> Run:
    """Greedy decode verifying ``propose``'s tree (a path is a tree) each forward."""
    from engine.mlx.tree_verify import keep_path, tree_forward

    cache = _prefill(model, prompt, prefilled)
    y, out = prompt[-1], list[int]()
    run = Run(tokens=out, seconds=0.0, calls=0)
    t0 = time.perf_counter()
    while len(out) < n and not (out and out[-1] in eos):
        d0 = time.perf_counter()
        tree = propose(prompt + out, min(budget, n - len(out) - 1))
        run.draft_s += time.perf_counter() - d0
        start = cache[0].offset
        if not tree.tokens:
            emitted = [_argmax(model(mx.array([[y]]), cache=cache)[:, -1:])[0]]
        elif all(p == i - 1 for i, p in enumerate(tree.parents)):  # a path: the causal window
            greedy = _argmax(model(mx.array([[y, *tree.tokens]]), cache=cache))
            path, emitted = tree.accept(greedy)
            for c in cache:
                c.trim(len(tree) - len(path))
        else:
            greedy = _argmax(tree_forward(model, cache, y, tree))
            path, emitted = tree.accept(greedy)
            keep_path(cache, start, path)
        run.calls += 1
        run.drafted += len(tree)
        run.accepted += len(emitted) - 1
        out.extend(emitted)
        y = emitted[-1]
    run.seconds = time.perf_counter() - t0
    run.tokens = _finish(out, n, eos)
    return run


class Drafting:
    """One arm's suffix decoding: the request's own text and its session's store."""

    def __init__(self, kind: str, params: SuffixParams):
        self.kind, self.params = kind, params
        self.store = SuffixStore(params)

    def proposer(self, prompt: list[int]) -> Proposer:
        own = SuffixIndex(self.params)
        own.extend(prompt)
        seen = [len(prompt)]

        def propose(context: list[int], budget: int) -> DraftTree:
            own.extend(context[seen[0] :])
            seen[0] = len(context)
            if budget <= 0:
                return NO_TREE
            if self.kind == "tree":
                a, b = own.propose_tree(context, budget), self.store.propose_tree(context, budget)
                return b if b.score > a.score else a
            pa, pb = own.propose(context, budget), self.store.propose(context, budget)
            best = pb if pb.score > pa.score else pa
            return DraftTree.of_path(best.tokens, best.match_len) if best.tokens else NO_TREE

        return propose


def _arms(spec: str) -> list[tuple[str, str, int]]:
    out = []
    for item in spec.split(","):
        kind, _, k = item.partition(":")
        if kind not in ("path", "tree") or not k.isdigit() or int(k) < 1:
            raise SystemExit(f"--arms: path:K or tree:K, got {item!r}")
        out.append((item, kind, int(k)))
    return out


def measure(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, dict[str, ArmStats]]:
    """Per workload, per arm: the runs' stats against plain's."""
    from bench.spec.workloads import agent_sessions, chat_prompts

    arms = _arms(args.arms)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    stats: dict[str, dict[str, ArmStats]] = {"agent": {}, "chat": {}}
    params = SuffixParams(alpha=args.alpha)
    for r in range(args.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]  # rotated, so drift hits every arm alike
        requests: list[tuple[str, list[int], Any]] = []
        for s in agent_sessions(args.sessions):
            requests += [("agent", [], s)] * s.TURNS
        requests += [("chat", p, None) for p in chat_prompts(tokenizer, args.chat)]
        drafting = {w: {name: Drafting(kind, params) for name, kind, _ in arms} for w in stats}
        for i, (workload, prompt, session) in enumerate(requests):
            if session is not None:
                prompt = session.next_prompt(tokenizer)
            prefilled = _prefill(model, prompt)
            base = plain(model, prompt, args.tokens, eos, prefilled)
            for name, _, k in order:
                d = drafting[workload][name]
                run = speculative(model, prompt, args.tokens, eos, d.proposer(prompt), k, prefilled)
                stats[workload].setdefault(name, ArmStats()).add(run, base)
                d.store.learn(prompt, run.tokens)
            stats[workload].setdefault("plain", ArmStats()).add(base, base)
            if session is not None:
                session.answered(tokenizer.decode(base.tokens))
            print(
                f"round {r + 1} request {i + 1}/{len(requests)} ({workload}, {len(prompt)} prompt tokens) done",
                flush=True,
            )
    return stats


def _geo(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def report(stats: dict[str, dict[str, ArmStats]], header: str) -> str:
    lines = [header, ""]
    for workload, arms in stats.items():
        if not arms:
            continue
        p = arms["plain"]
        step = p.seconds / max(1, p.calls)
        lines += [
            f"### {workload}, batch 1",
            "",
            "| arm | speedup (geo. mean) | median | identical | tok/call | acceptance | mean window | call ÷ step | drafting share | tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, a in arms.items():
            calls = max(1, a.calls)
            lines.append(
                f"| {name} | {_geo(a.speedups):.2f}× | {statistics.median(a.speedups):.2f}× | {a.identical}/{a.requests} "
                f"| {a.tokens / calls:.2f} | {a.accepted / max(1, a.drafted):.0%} | {1 + a.drafted / calls:.2f} "
                f"| {a.seconds / calls / step:.2f} | {a.draft_s / max(1e-9, a.seconds):.1%} | {a.tokens / max(1e-9, a.seconds):.1f} |"
            )
        lines.append("")
    paths = {n[5:]: n for n in next(iter(stats.values())) if n.startswith("path:")}
    pairs = [(paths[n[5:]], n) for a in stats.values() for n in a if n.startswith("tree:") and n[5:] in paths]
    if pairs:
        lines += ["### Trees against paths of the same budget (ratio of the geometric-mean speedups)", ""]
        lines += ["| workload | " + " | ".join(f"{t} ÷ {p}" for p, t in dict.fromkeys(pairs)) + " |"]
        lines += ["|---|" + "---|" * len(dict.fromkeys(pairs))]
        for workload, arms in stats.items():
            cells = [f"{_geo(arms[t].speedups) / _geo(arms[p].speedups):.3f}×" for p, t in dict.fromkeys(pairs)]
            lines.append(f"| {workload} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.spec.tree", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--arms", default="path:8,tree:8,path:16,tree:16", help="path:K / tree:K, comma-separated")
    ap.add_argument("--sessions", type=int, default=2, help="agent sessions (3 turns each)")
    ap.add_argument("--chat", type=int, default=2, help="chat prompts")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=1.0, help="a match of length ℓ drafts at most alpha·ℓ tokens")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)

    from bench import docs as bench_docs
    from engine.config import EngineConfig
    from engine.mlx.loading import read_model
    from engine.models import resolve_model

    loaded = read_model(resolve_model(args.model), EngineConfig(model=args.model))
    t0 = time.time()
    stats = measure(loaded.model, loaded.tokenizer, args)
    commit = bench_docs.commit()  # +dirty where the tree has uncommitted changes
    cmd = "python -m bench.spec.tree " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"Command: `{cmd}`, commit `{commit}`\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cpus, load average at the end "
        f"{os.getloadavg()[0]:.1f}; model `{args.model}`; up to {args.tokens} tokens a request, greedy, "
        f"batch 1; {args.rounds} rounds in {(time.time() - t0) / 60:.1f} min."
    )
    text = report(stats, header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
