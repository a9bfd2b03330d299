"""Windows the backend stops at a rejected first draft (``StepResult.stopped``).

Where a window's first position is the decode step the MLX backend ran ahead,
the target's token after ``last`` is known before the drafts are fed; when it
is not the first draft, the drafts are never fed and the round costs a plain
step (engine.mlx.run_ahead ``_verify_rest``; the backend's own test is
tests/engine/test_mlx_backend.py). Here: the Verifier reads such a window as a
rejection, not as a cache that cannot take windows; the Scheduler owes no trim
and costs the round as a plain one; and adaptive γ prices a lone row's window
after a plain round by its first draft's acceptance.
"""

from __future__ import annotations

import pytest

from actors.spec_rounds import SpecRounds
from actors.verifier import VerifierCore, Verify, Window, accept_window
from engine.ports import StepPlan, VerifyRow
from engine.speculation.policy import GammaPolicy
from engine.types import SamplingParams


def test_a_window_stopped_at_its_first_rejection_is_judged_as_one():
    assert accept_window([5, 6, 7], [9]) == (0, [9])
    assert accept_window([5, 6, 7], [5, 1]) == (1, [5, 1])  # a backend may stop at any rejection
    with pytest.raises(ValueError):
        accept_window([5, 6, 7], [5])  # short, yet its last target agrees: not a rejection
    with pytest.raises(ValueError):
        accept_window([5, 6, 7], [5, 6])
    with pytest.raises(ValueError):
        accept_window([5, 6, 7], [])


def test_the_verifier_keeps_a_stopped_row_drafting_and_learns_that_the_backend_stops():
    core = VerifierCore(GammaPolicy(fixed=3))
    stopped = core.verify(Verify(windows=[Window(rid=1, drafts=[5, 6, 7], targets=[9], fixed_gamma=3, stopped=True)]))
    v = stopped.verdicts[0]
    assert (v.accepted, v.tokens, v.fallback, v.gamma_next) == (0, [9], False, 3)
    assert core.policy.stops and core.rows[1].after_plain and not core.rows[1].off
    assert core.stats()["windows_stopped"] == 1  # /stats speculation
    # The same one target without the flag is a window the backend cut (a cache
    # that cannot be trimmed): plain decode from then on.
    cut = core.verify(Verify(windows=[Window(rid=2, drafts=[5, 6, 7], targets=[9], fixed_gamma=3)]))
    assert cut.verdicts[0].fallback and core.rows[2].off
    fed = core.verify(Verify(windows=[Window(rid=1, drafts=[5, 6], targets=[5, 6, 8], fixed_gamma=3)]))
    assert fed.verdicts[0].accepted == 2 and not core.rows[1].after_plain


class _Row:
    def __init__(self, rid: int):
        self.rid, self.prompt, self.generated = rid, [1, 2, 3], [4]
        self.params = SamplingParams(max_tokens=100)
        self.next_input = 4


@pytest.mark.parametrize("free", [True, False], ids=["free-drafter", "draft-model"])
def test_a_stopped_window_owes_no_trim_and_is_costed_as_a_plain_round(free):
    """... when drafting is free; a draft model ran its steps for the drafts,
    so its round keeps the planned drafts' shape."""
    spec = SpecRounds(context_length=4096, free_drafts=free)
    spec.admit(1, SamplingParams(max_tokens=100))
    row = _Row(1)
    spec.rows[1].drafts = [5, 6, 7]
    plan = StepPlan(verify=[VerifyRow(1, [4, 5, 6, 7])])
    assert spec.collect(row, [9], stopped=True)
    spec.note_step(plan, 10.0, 0.0, ok=True, more=True)
    msg = spec.take_verify()
    assert msg is not None and msg.windows[0].stopped
    core = VerifierCore(GammaPolicy(fixed=3))
    row.in_cache = 4
    spec.apply(core.verify(msg), {1: row}, lambda r, toks: r.generated.extend(toks))
    assert spec.owed == {} and row.generated == [4, 9] and row.in_cache == 5
    spec.note_step(StepPlan(), 10.5, 0.0, ok=True, more=False)  # closes the round: costed now
    (cost,) = [c for shape in spec.costs.values() for c in shape]
    assert (cost.gamma, cost.drafted) == (3, 0 if free else 3)  # planned three drafts, fed none


def _priced(stops: bool, first: float, free: bool = True) -> int:
    """The γ a lone row chooses where a verify round that fed its drafts costs
    2.5 plain rounds at any depth, and drafts after the first are accepted
    60% of the time. ``stops``: the backend was seen to stop windows;
    ``free``: the drafter costs nothing a round (not a draft model)."""
    p = GammaPolicy(gamma_max=6, free_drafts=free)
    for d in range(1, 7):
        p.observe_costs([(0, 0.010, 1, 0, 0.0)] * 8 + [(d, 0.025, 1, d, 0.0)] * 4 + [(0, 0.010, 1, 0, 0.0)] * 8)
    p.stops = stops
    row = p.new_row(None)
    row.accept = [first] + [0.6] * 5
    row.seen = [50] * 6
    row.consulted, row.after_plain, row.accepted_any = True, True, True
    return p.best(row)


def test_a_lone_rows_window_after_a_plain_round_costs_its_drafts_only_if_the_first_is_accepted():
    """First draft accepted 30%: 1.70 tokens a round for 2.5 plain rounds when
    every window is fed (plain decode wins); where a rejected first draft costs
    a plain step, the round costs 0.3·2.5 + 0.7 = 1.45 plain rounds for those
    1.70 tokens (drafting wins, deep: from the second draft on it pays)."""
    assert _priced(stops=False, first=0.3) == 0
    assert _priced(stops=True, first=0.3) >= 2
    # γ = 1 there gives two tokens for two forwards at best: never a gain on its own.
    assert _priced(stops=True, first=0.05) == 0
    # A draft model ran its steps whether or not its first draft is accepted.
    assert _priced(stops=True, first=0.3, free=False) == 0
