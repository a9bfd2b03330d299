"""bench.serve.vs_mlx_lm's report states issue 24's targets and the full command (no
servers: the report is computed from hand-made samples)."""

from __future__ import annotations

import argparse

from bench.serve.vs_mlx_lm import Results, report


def _args(**kw) -> argparse.Namespace:
    base = dict(model="smollm2-135m", rounds=2, legs="decode1,agg8,bare", gamma=2, long_tokens=1500, long_rounds=1)
    return argparse.Namespace(**{**base, "out": "docs/x.md", **kw})


def _results() -> Results:
    r = Results()
    for leg, who, xs in (
        ("decode1", "ember", [10.0, 12.0]),
        ("decode1", "mlx-lm", [10.0, 10.0]),
        ("agg8", "ember", [60.0, 62.0]),
        ("agg8", "mlx-lm", [50.0, 50.0]),
        ("bare", "mlx_lm.stream_generate", [12.0, 10.0]),
        ("bare", "1 thread", [9.0, 12.0]),
    ):
        for x in xs:
            r.add(leg, who, x)
    r.load = [3.0, 5.0, 4.0]
    return r


def test_the_report_uses_issue_24_targets_and_the_full_command():
    text = report(_results(), _args())
    assert (
        "Command: `python -m bench.serve.vs_mlx_lm --model smollm2-135m --rounds 2 --legs decode1,agg8,bare --gamma 2 "
        "--long-tokens 1500 --long-rounds 1 --out docs/x.md`" in text
    )
    lines = {ln.split(" | ")[0]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert lines["| single stream vs mlx_lm.server >= 1.0×"].endswith("| MET |")  # 1.1× and paired 1.1×
    assert lines["| 8-stream aggregate vs mlx_lm.server >= 1.3×"].endswith("| NOT MET |")  # 1.22×
    # the bare ceiling is the faster setting of each round (12, 12): 11 / 12
    bare = next(v for k, v in lines.items() if k.startswith("| single stream vs the bare"))
    assert ">= 0.97×" in bare and "| 0.917× |" in bare and bare.endswith("| NOT MET |")
    assert "median 4.0" in text  # the load average is stated
    assert "| agg8 | tok/s |" in text and "| >= 1.3× |" in text
