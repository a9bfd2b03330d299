"""bench.spec.vs_mlx_lm's pure parts: arguments, γ flags, prompt rotation,
ratios and the report (no servers: hand-made rounds)."""

from __future__ import annotations

import pytest

from bench.spec.vs_mlx_lm import counter_deltas, ember_gamma_flags, parse_args, ratios, report, round_prompts

BASE = ["--model", "/m", "--draft-model", "/d"]


def test_defaults_and_gamma_flags():
    args = parse_args(BASE)
    assert (args.rounds, args.concurrency, args.max_tokens, args.gamma) == (5, 4, 160, 3)
    assert ember_gamma_flags(args) == ["--num-draft-tokens", "3"]  # 'same': mlx-lm's γ
    assert ember_gamma_flags(parse_args([*BASE, "--ember-gamma", "adaptive"])) == []
    assert ember_gamma_flags(parse_args([*BASE, "--gamma", "2", "--ember-gamma", "5"])) == ["--num-draft-tokens", "5"]


@pytest.mark.parametrize(
    "extra", [["--ember-gamma", "fast"], ["--ember-gamma", "0"], ["--rounds", "0"], ["--concurrency", "0"]]
)
def test_bad_arguments_are_refused(extra, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *extra])
    assert extra[0] in capsys.readouterr().err


def test_draft_model_is_required():
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m"])


def test_round_prompts_rotate_and_wrap():
    p = list("abcdefgh")
    assert round_prompts(p, 0, 4) == list("abcd")
    assert round_prompts(p, 1, 4) == list("efgh")
    assert round_prompts(p, 2, 4) == list("abcd")
    assert round_prompts(p, 1, 3) == list("def")
    assert round_prompts(list("abc"), 0, 5) == list("abcab")


def test_ratios_median_and_paired():
    r = ratios([30.0, 20.0, 40.0], [10.0, 20.0, 10.0])
    assert r["ember"] == 30.0 and r["mlx_lm"] == 10.0
    assert r["ratio_of_medians"] == pytest.approx(3.0)
    assert r["paired_median"] == pytest.approx(3.0)  # per round: 3, 1, 4
    assert (r["paired_min"], r["paired_max"]) == (pytest.approx(1.0), pytest.approx(4.0))
    empty = ratios([], [])
    assert empty["ratio_of_medians"] is None and empty["paired_median"] is None


def _row(tps: float) -> dict:
    return {"tps": tps, "tokens": 640, "wall_s": 640 / tps, "ttft_first_s": 0.5, "ttft_last_s": 20.0}


def test_report_states_the_target_and_the_verdict():
    args = parse_args(BASE)
    res = {
        "rows": {"ember": [_row(30.0), _row(32.0)], "mlx-lm": [_row(12.0), _row(20.0)]},
        "load": [2.0, 3.0, 2.5],
        "summary": ratios([30.0, 32.0], [12.0, 20.0]),
        "ember_spec": {"drafted": 900, "accepted": 300},
    }
    text = report(res, args)
    assert "paired median **2.05×**" in text  # (2.5 + 1.6) / 2
    assert "target ≥ 2×: met" in text
    assert "drafted 900, accepted 300" in text
    res["summary"] = ratios([30.0, 32.0], [20.0, 20.0])
    assert "target ≥ 2×: NOT met" in report(res, args)


def test_counter_deltas_leave_rates_out_and_recompute_acceptance():
    before = {
        "spec_decode_num_draft_tokens": 10,
        "spec_decode_num_accepted_tokens": 5,
        "acceptance_rate": 0.5,
        "rows": 2,
    }
    after = {
        "spec_decode_num_draft_tokens": 110,
        "spec_decode_num_accepted_tokens": 30,
        "acceptance_rate": 0.27,
        "rows": 0,
    }
    d = counter_deltas(before, after)
    assert d == {"spec_decode_num_draft_tokens": 100, "spec_decode_num_accepted_tokens": 25, "acceptance": 0.25}
