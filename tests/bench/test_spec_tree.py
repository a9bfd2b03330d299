"""bench.spec.tree's decode loop: a tree or a path verified each forward
emits exactly plain greedy decode's tokens, in fewer forwards when it drafts
them; and the whole measurement runs and reports on the bundled model."""

from __future__ import annotations

import argparse

import pytest

from bench.spec import tree as bt
from engine.speculation.suffix import NO_TREE, DraftTree


@pytest.fixture(scope="module")
def loaded():
    from mlx_lm import load

    from engine.models import resolve_model

    return load(str(resolve_model("tiny")))


def _future_proposer(prompt, future, wrong_first):
    """Drafts the true continuation, on a tree's second branch when
    ``wrong_first`` (a decoy branch first), so acceptance must walk the tree."""

    def propose(context, budget):
        done = len(context) - len(prompt)
        nxt = future[done : done + min(budget, 4)]
        if not nxt:
            return NO_TREE
        if not wrong_first:
            return DraftTree.of_path(nxt)
        decoy = (nxt[0] + 1) % 100
        tokens = [decoy, decoy, *nxt]
        parents = [-1, 0, -1, *range(2, 2 + len(nxt) - 1)]
        return DraftTree(tokens=tokens, parents=parents, score=1.0, match_len=2)

    return propose


@pytest.mark.parametrize("wrong_first", [False, True], ids=["path", "tree"])
def test_the_loop_emits_plain_greedy_tokens_in_fewer_forwards(loaded, wrong_first):
    model, tok = loaded
    prompt = tok.encode("def fibonacci(n):\n    ")
    base = bt.plain(model, prompt, 24, eos=set())
    run = bt.speculative(model, prompt, 24, set(), _future_proposer(prompt, base.tokens, wrong_first), 8)
    assert run.tokens == base.tokens
    # 4 drafted tokens and the target's own a call: 24 tokens in 5 calls
    assert run.calls == -(-len(base.tokens) // 5)
    assert run.accepted == len(base.tokens) - run.calls


def test_wrong_drafts_cost_forwards_not_tokens(loaded):
    model, tok = loaded
    prompt = tok.encode("import os\n")
    base = bt.plain(model, prompt, 16, eos=set())
    bad = [(t + 7) % 100 for t in base.tokens]
    run = bt.speculative(model, prompt, 16, set(), _future_proposer(prompt, bad, True), 8)
    assert run.tokens == base.tokens
    assert run.calls == len(base.tokens)


def test_the_measurement_runs_and_reports(loaded):
    model, tok = loaded
    args = argparse.Namespace(arms="path:4,tree:4", sessions=1, chat=1, tokens=12, rounds=1, alpha=1.0)
    stats = bt.measure(model, tok, args)
    assert set(stats) == {"agent", "chat"}
    for workload, arms in stats.items():
        assert set(arms) == {"plain", "path:4", "tree:4"}
        for name, a in arms.items():
            assert a.identical == a.requests, (workload, name)  # greedy output never changes
    text = bt.report(stats, "header")
    assert "tree:4 ÷ path:4" in text and "### agent, batch 1" in text
