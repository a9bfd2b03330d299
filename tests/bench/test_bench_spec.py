"""The speculation benchmark's free-drafter ceiling: tokens per target call
over the relative cost of the γ+1-token verify forward."""

from bench.spec.sweep import ceiling


def test_the_ceiling_divides_tokens_per_call_by_the_window_cost():
    width = {1: 2.0, 2: 2.8, 3: 3.0, 4: 3.6, 5: 4.0}
    assert ceiling(1.5, 2, width) == 1.5 / (3.0 / 2.0)
    assert ceiling(2.8, 4, width) == 2.8 / 2.0
    # a γ that accepts nothing is slower than plain decode by the window's cost
    assert ceiling(1.0, 1, width) < 1.0
    # a drafter's own steps come on top of the verify window
    assert ceiling(1.5, 2, width, draft_step_ms=0.5) == 1.5 / ((3.0 + 2 * 0.5) / 2.0)


def test_no_ceiling_without_a_fixed_gamma_or_a_measured_window():
    width = {1: 2.0, 2: 2.8}
    assert ceiling(None, 1, width) is None  # speculation off: no target calls counted
    assert ceiling(1.4, None, width) is None  # adaptive γ mixes window widths
    assert ceiling(1.4, 3, width) is None  # the 4-token window was not measured
    assert ceiling(1.4, 1, None) is None


def test_the_adaptive_bench_interval_is_a_t_interval_of_log_ratios():
    import math
    import statistics

    from bench.spec.adaptive import paired_interval, t95, verdict

    ratios = [0.95, 1.02, 0.99, 1.04, 0.98, 1.01]
    g, lo, hi = paired_interval(ratios)
    logs = [math.log(r) for r in ratios]
    half = 2.571 * statistics.stdev(logs) / math.sqrt(6)  # t(0.975, df=5)
    assert g == math.exp(statistics.fmean(logs))
    assert (lo, hi) == (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    # between tabulated degrees of freedom the wider (lower-df) quantile is used
    assert t95(11) == t95(10) > t95(12)
    assert verdict(0.975, 1.01) == "**met**"
    assert verdict(0.95, 1.01) == "not resolved"
    assert verdict(0.90, 0.96) == "**missed**"


def test_the_adaptive_target_is_the_geometric_mean_over_all_rounds():
    from bench.spec.report import adaptive_targets
    from bench.spec.sweep import Arm

    adaptive, fixed, control = Arm("ngram", None), Arm("ngram", 4), Arm("ngram", None, control=True)
    control.ratios = {("chat", 1): [1.02, 0.97, 1.0]}  # beside the verdict, never judged by it
    control.identical = {("chat", 1): [True, True, True]}
    adaptive.ratios = {("chat", 1): [0.97, 1.0, 0.99], ("edit", 4): [0.99, 0.96, 0.97]}
    adaptive.identical = {("chat", 1): [True, True, True], ("edit", 4): [True, False, True]}
    fixed.ratios = {("chat", 1): [0.5]}  # a fixed γ is not judged by this target
    fixed.identical = {("chat", 1): [True]}
    text = adaptive_targets({"ngram": [fixed, adaptive, control]}, ["ngram"], ["chat", "edit"], [1, 4])
    rows = [line for line in text.splitlines() if line.startswith("| ngram")]
    assert len(rows) == 2
    # chat: the baseline is both plain runs, (0.97/√1.02, 1.0/√0.97, 0.99/√1.0); edit: no control, the first run
    assert "| chat | 1 | 0.988× |" in rows[0] and rows[0].endswith("| 3/3 | 0.987× | 0.996× | met |")
    assert "| edit | 4 | 0.973× |" in rows[1] and rows[1].endswith("| 2/3 | 0.973× | – | **NOT MET** |")
    assert text.endswith("1 of 2 cells met.")


def test_side_by_side_divides_each_round_by_the_first_drafters_adaptive_arm():
    from bench.spec.report import side_by_side
    from bench.spec.sweep import Arm

    ngram, suffix = Arm("ngram", None), Arm("suffix", None)
    ngram.tps = {("agent", 1): [100.0, 120.0]}
    ngram.ratios = {("agent", 1): [1.6, 2.0]}
    suffix.tps = {("agent", 1): [150.0, 150.0], ("chat", 1): [50.0]}  # chat: ngram did not run it
    suffix.ratios = {("agent", 1): [2.5, 2.5], ("chat", 1): [1.0]}
    arms = {"ngram": [ngram, Arm("ngram", None, control=True)], "suffix": [suffix]}
    text = side_by_side(arms, ["ngram", "suffix"], ["agent", "chat"], [1])
    rows = [line for line in text.splitlines() if line.startswith("| agent") or line.startswith("| chat")]
    # per round 1.5 and 1.25: geometric mean √1.875
    assert rows == [f"| agent | 1 | {(1.6 * 2.0) ** 0.5:.2f}× | 2.50× | {1.875**0.5:.2f}× (" + rows[0].split("(")[1]]
    assert side_by_side(arms, ["ngram"], ["agent"], [1]) == ""
    assert Arm("suffix+ngram", None).name == "suffix+ngram adaptive"
