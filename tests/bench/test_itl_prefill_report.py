"""The ITL-under-prefill leg's numbers on made-up arrivals (bench/itl_prefill_report.py):
percentiles, which gaps the prefill window takes, coverage, and a verdict that can miss."""

from __future__ import annotations

import pytest

from bench.itl_prefill_report import (
    covers,
    itls,
    percentile,
    report,
    round_table,
    summarize,
    summary_table,
    verdict,
    window_itls,
)


def ticks(start: float, step: float, n: int) -> list[float]:
    return [start + i * step for i in range(n)]


def test_percentile_interpolates_between_ranks():
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0 and percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([], 99) is None


def test_the_window_takes_every_gap_that_overlaps_it():
    arrivals = [0.0, 1.0, 2.0, 10.0, 11.0]
    assert itls(arrivals) == [1.0, 1.0, 8.0, 1.0]
    # a stall spanning the whole window is one gap, never none
    assert window_itls(arrivals, 3.0, 9.0) == [8.0]
    # gaps ending inside it and the one running past its end both count; those outside do not
    assert window_itls(arrivals, 1.5, 10.5) == [1.0, 8.0, 1.0]
    assert window_itls(arrivals, 11.5, 12.0) == []


def test_coverage_needs_chunks_on_both_sides_of_the_window():
    s = [0.0, 1.0, 2.0, 3.0]
    assert covers(s, 0.5, 3.0)
    assert not covers(s, 0.5, 3.5)  # ended inside the prefill
    assert not covers(s, -1.0, 2.0)  # started after the long request was sent
    assert not covers([], 0.0, 1.0)


def rnd(server: str, r: int, alone_step: float, stall: float) -> object:
    """Two streams decoding at ``alone_step``; under prefill, each stalls for
    ``stall`` from its last chunk at ~10 s, and the window lies inside the stall
    (so it takes exactly one gap per stream)."""
    alone = [ticks(0.0, alone_step, 100), ticks(0.001, alone_step, 100)]
    under = []
    for off in (0.0, 0.001):
        before = ticks(off, alone_step, int(10 / alone_step) + 1)
        after = ticks(before[-1] + stall, alone_step, 40)
        under.append(before + after)
    window = (10.002, 10.0 + stall - 0.002)
    return summarize(server, r, alone, under, window, long_prompt_tokens=7000, load=1.0)


def test_ratio_and_verdict_met_and_missed():
    good = [rnd("ember", r, 0.02, 0.03) for r in (1, 2, 3)] + [rnd("mlx_lm.server", 1, 0.02, 2.0)]
    r = good[0]
    assert r.p50_alone == pytest.approx(0.02) and r.covering == 2 and r.streams == 2
    assert r.under == pytest.approx([0.03, 0.03]) and r.ratio == pytest.approx(1.5)
    v = verdict(good)
    assert v.met is True and v.measured.startswith("1.50×") and "mlx_lm.server: 100.00×" in v.measured

    bad = [rnd("ember", r, 0.02, 0.5) for r in (1, 2, 3)]
    v = verdict(bad)
    assert v.met is False and v.measured.startswith("25.00×")


def test_the_verdict_takes_the_median_of_rounds():
    rounds = [rnd("ember", 1, 0.02, 0.03), rnd("ember", 2, 0.02, 0.03), rnd("ember", 3, 0.02, 5.0)]
    assert verdict(rounds).met is True  # one bad round of three is not the median
    rounds.append(rnd("ember", 4, 0.02, 5.0))
    rounds.append(rnd("ember", 5, 0.02, 5.0))
    assert verdict(rounds).met is False


def test_an_uncovered_window_is_flagged_and_no_rounds_is_not_measured():
    r = rnd("ember", 1, 0.02, 0.03)
    r.covering = 1
    assert "1/1 rounds had a stream end inside the window" in verdict([r]).measured
    assert verdict([rnd("mlx_lm.server", 1, 0.02, 1.0)]).met is None


def test_tables_print_every_round_and_the_ember_over_mlx_lm_row():
    rounds = [rnd("ember", 1, 0.02, 0.03), rnd("ember", 2, 0.02, 0.05), rnd("mlx_lm.server", 1, 0.01, 1.0)]
    t = round_table(rounds)
    assert t.count("| ember |") == 2 and "| mlx_lm.server | 1 |" in t and "2/2" in t
    s = summary_table(rounds)
    assert "| ember / mlx_lm.server | 2.00× |" in s  # p50 alone: 20 ms over 10 ms
    text = report(rounds, command="python -m bench.itl_prefill", commit="abc1234", load_before="1", load_after="2")
    assert "abc1234" in text and "**met**" in text
