"""The agent-session benchmark's verdicts on made-up turns (bench/agent_session_report.py):
each target can fail, and the table and the time split say what was measured."""

from __future__ import annotations

import pytest

from bench.agent_session_report import Turn, covered, split_turn, totals, turn_table, verdicts


def session(server: str, *, wall: float, ttft: float, tps: float, cached_gap: int = 0, reply: str = "r") -> list[Turn]:
    rows, prompt = [], 300
    for k in range(1, 7):
        prev = prompt
        prompt += 300
        rows.append(
            Turn(
                server=server,
                turn=k,
                prompt_tokens=prompt,
                cached_tokens=0 if k == 1 else prev - cached_gap,
                ttft_s=ttft * (10 if k == 1 else 1),
                decode_tps=tps,
                completion_tokens=64,
                wall_s=wall,
                reply=f"{reply}{k}",
                after_restart=k == 4,
            )
        )
    return rows


def test_a_session_that_wins_everywhere_meets_every_target():
    rows = session("ember", wall=1.0, ttft=0.1, tps=30) + session("mlx_lm.server", wall=2.5, ttft=0.5, tps=12)
    vs = verdicts(rows)
    assert all(v.met for v in vs if v.met is not None), [(v.target, v.measured) for v in vs]
    assert any(v.met is None and "adaptive" in v.target for v in vs)  # never claimed by this run
    assert "2.50× mlx_lm.server" in vs[0].measured


@pytest.mark.parametrize(
    "ember, target",
    [
        (dict(wall=1.5, ttft=0.1, tps=30), "session wall time"),  # 1.67×, under 2×
        (dict(wall=1.0, ttft=0.45, tps=30), "warm-turn TTFT"),  # 0.9× the peer's
        (dict(wall=1.0, ttft=0.1, tps=20), "decode"),  # 1.67×
        (dict(wall=1.0, ttft=0.1, tps=30, cached_gap=40), "every turn's cached prefix"),
        (dict(wall=1.0, ttft=0.1, tps=30, reply="x"), "ember: greedy replies"),
    ],
)
def test_each_target_can_miss(ember, target):
    rows = session("ember", **ember) + session("mlx_lm.server", wall=2.5, ttft=0.5, tps=12)
    missed = [v.target for v in verdicts(rows) if v.met is False]
    assert missed and all(m.startswith(target) for m in missed), missed


def test_the_worst_peer_does_not_hide_the_best():
    rows = (
        session("ember", wall=1.0, ttft=0.1, tps=30)
        + session("mlx_lm.server", wall=3.0, ttft=0.5, tps=12)
        + session("vllm-mlx", wall=1.2, ttft=0.11, tps=14)
    )
    vs = {v.target: v for v in verdicts(rows)}
    assert vs["session wall time ≥ 2.0× every peer"].met is False
    assert vs["warm-turn TTFT ≤ 0.8× the best peer's (median)"].met is False
    assert vs["vllm-mlx: greedy replies identical to mlx_lm.server"].measured == "6/6"


def test_coverage_allows_the_template_boundary_only():
    assert covered(session("e", wall=1, ttft=1, tps=1, cached_gap=2)) == (5, 5)
    assert covered(session("e", wall=1, ttft=1, tps=1, cached_gap=3)) == (0, 5)
    rows = session("e", wall=1, ttft=1, tps=1)
    rows[2].cached_tokens = None  # a server that does not report it does not cover
    assert covered(rows) == (4, 5)


def test_totals_and_the_table():
    rows = session("ember", wall=1.0, ttft=0.1, tps=30) + session("mlx_lm.server", wall=2.0, ttft=0.5, tps=12)
    t = totals(rows[:6])
    assert t["session_s"] == pytest.approx(6.0) and t["restart_ttft_s"] == pytest.approx(0.1)
    assert t["warm_ttft_median_s"] == pytest.approx(0.1) and t["ttft_sum_s"] == pytest.approx(1.5)
    table = turn_table(rows)
    assert "| restart → 4 |" in table and "/ ref |" in table and "/ yes |" in table


def test_the_split_of_a_turn():
    t = Turn(
        "ember",
        4,
        1500,
        1200,
        ttft_s=2.0,
        decode_tps=30,
        completion_tokens=64,
        wall_s=4.0,
        reply="",
        after_restart=True,
    )
    s = split_turn(t, attention_share=0.25, warm_s_per_token=0.004)  # 300 new tokens: 1.2 s expected
    assert s["new_tokens"] == 300 and s["restore_s"] == pytest.approx(0.8)
    assert s["prefill_attention_s"] == pytest.approx(0.3) and s["prefill_weights_s"] == pytest.approx(0.9)
    assert s["decode_s"] == pytest.approx(2.0)
    assert "attention_gemm_s" not in s
    s = split_turn(t, attention_share=0.25, warm_s_per_token=0.004, gemm_share=0.6)
    assert s["attention_gemm_s"] == pytest.approx(0.18)  # 0.6 of the 0.3 s of attention
