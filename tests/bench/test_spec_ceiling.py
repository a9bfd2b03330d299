"""The copy-drafter ceilings (bench.spec.ceiling) on hand-made token lists: no model."""

import random

import pytest

from actors.verifier import accept_window
from bench.spec.ceiling import AlignerDrafter, NgramDrafter, OracleDrafter, ceilings, replay, report
from engine.speculation.ngram import NgramIndex

PROMPT = list(range(100, 140))  # 40 distinct tokens: one alignment, no accidental repeats


class Silent:
    def propose(self, k: int) -> list[int]:
        return []

    def accepted(self, tokens: list[int]) -> None:
        pass


def test_a_drafter_that_proposes_nothing_gets_one_token_per_call():
    r = replay(PROMPT[:10], 4, Silent())
    assert r.tokens_per_call == 1.0
    assert r.drafted == r.accepted == 0


@pytest.mark.parametrize("gamma", [2, 4, 6])
def test_an_exact_copy_gives_gamma_plus_one_tokens_per_call_to_the_oracle_and_the_aligner(gamma):
    output = PROMPT[5 : 5 + 3 * (gamma + 1)]  # three full rounds
    r = ceilings(PROMPT, output, gamma)
    assert r["oracle"].tokens_per_call == gamma + 1
    assert r["aligner"].tokens_per_call == gamma + 1
    assert r["aligner"].acceptance == 1.0
    # the lookup needs min_n tokens of the copy before it finds its place
    assert r["ngram"].tokens_per_call < gamma + 1


def test_a_substitution_costs_the_oracle_and_the_aligner():
    gamma = 4
    output = PROMPT[5:25]
    output[7] = 999  # a token the prompt does not have: no copy drafter can propose it
    r = ceilings(PROMPT, output, gamma)
    assert r["oracle"].tokens_per_call < gamma + 1
    assert r["aligner"].tokens_per_call < gamma + 1
    assert r["aligner"].tokens_per_call > 1.0  # it resumes after the change
    assert AlignerDrafter(PROMPT, output).covered == len(output) - 1


def test_the_aligner_follows_the_source_after_a_skipped_stretch_where_the_oracle_may_do_better():
    # the output skips prompt[15:25] and repeats its own first line: the
    # aligner's single alignment cannot draft the repeat, the oracle can
    output = PROMPT[5:15] + PROMPT[25:35] + PROMPT[5:15]
    r = ceilings(PROMPT, output, 4)
    assert r["oracle"].tokens_per_call >= r["aligner"].tokens_per_call
    assert r["oracle"].tokens_per_call == 5.0


def test_the_oracle_continues_a_repetition_into_the_tokens_it_copies():
    # a loop with period 2 after a context that has the pair once: only a copy
    # that runs into its own output drafts the whole window
    prompt = [1, 2, 3, 7, 8]
    output = [7, 8] * 6
    assert OracleDrafter(prompt, output).propose(6) == [7, 8, 7, 8, 7, 8]


def _verifier_tokens_per_call(prompt: list[int], output: list[int], gamma: int) -> float:
    """Prompt lookup replayed with the Verifier's own acceptance rule (``accept_window``)."""
    index = NgramIndex()
    index.extend(list(prompt))
    i = calls = 0
    while i < len(output):
        draft = index.propose(gamma)[: len(output) - i - 1]
        _, emitted = accept_window(draft, output[i : i + len(draft) + 1])
        index.extend(emitted)
        i += len(emitted)
        calls += 1
    return len(output) / calls


def test_the_ngram_drafter_replays_as_the_verifier_accepts():
    # the Verifier's own rule (actors.verifier.accept_window): an independent check of replay()
    rng = random.Random(7)
    for _ in range(20):
        prompt = [rng.randrange(12) for _ in range(60)]
        output = [rng.randrange(12) for _ in range(40)]
        for gamma in (1, 3, 5):
            got = replay(output, gamma, NgramDrafter(prompt)).tokens_per_call
            assert got == pytest.approx(_verifier_tokens_per_call(prompt, output, gamma))


def _edited_copy(rng: random.Random, prompt: list[int]) -> list[int]:
    """A stretch of the prompt with substitutions, skips and insertions."""
    start = rng.randrange(len(prompt) // 2)
    out = []
    j = start
    while len(out) < 48 and j < len(prompt):
        roll = rng.random()
        if roll < 0.08:
            out.append(rng.randrange(50))  # substitution or insertion
        elif roll < 0.12:
            j += rng.randrange(1, 6)  # skip
        else:
            out.append(prompt[j])
        j += 1
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_oracle_is_never_below_the_aligner_or_the_lookup(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(50) for _ in range(120)]
    outputs = [_edited_copy(rng, prompt), [rng.randrange(8) for _ in range(40)], [3, 4, 5] * 10]
    for output in outputs:
        for gamma in (1, 2, 4, 6):
            r = ceilings(prompt, output, gamma)
            oracle = r["oracle"].tokens_per_call
            for name in ("aligner", "ngram", "ngram-recent"):
                assert oracle >= r[name].tokens_per_call - 1e-12, name
            assert oracle <= gamma + 1


def test_the_report_divides_the_mean_by_each_gammas_verify_cost():
    output = PROMPT[5:25]
    text = report([("copy0", PROMPT, output)], [4], [2.0])
    r = ceilings(PROMPT, output, 4)
    assert f"oracle {r['oracle'].tokens_per_call:.2f}" in text
    assert f"oracle {r['oracle'].tokens_per_call / 2.0:.2f}×" in text
    assert f"ngram {r['ngram'].tokens_per_call / 2.0:.2f}×" in text


def test_the_agreement_tally_buckets_proposals_by_how_far_the_match_agrees():
    from bench.spec.agreement import table, tally

    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # The output copies the prompt from its start: each proposal's match agrees one token more.
    got = tally(prompt, prompt)
    assert sorted(got) == [2, 3, 4, 5, 6] and all(r[:2] == [1, 1] for r in got.values())
    assert [got[m][2] for m in sorted(got)] == [6, 5, 4, 3, 2]  # drafts accepted: up to the output's end
    departs = tally(prompt, [3, 4, 5, 6, 7, 9, 9])  # copies the middle, then departs
    assert departs[max(departs)][1] == 0  # the departure's proposal is rejected
    assert "| copy | 2 |" in table({"copy": {2: [4, 2, 3]}}) and "0.50 | 0.75 |" in table({"copy": {2: [4, 2, 3]}})
