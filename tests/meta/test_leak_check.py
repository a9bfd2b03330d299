"""The suite's own guard (tests/conftest.py): a module whose tests leave an
engine thread running fails, naming the thread; one that closes it passes."""

from __future__ import annotations

import pathlib

import pytest

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[2]

CONFTEST = """
from tests.conftest import pytest_runtest_setup, pytest_runtest_teardown  # the hooks under test
"""

LEAKY = """
from engine.mlx.device import MLXThread

def test_opens_a_thread_and_forgets_it():
    MLXThread(name="ember-mlx-leaked").call(lambda: None)

def test_a_later_test_in_the_same_module():
    pass
"""

CLOSED = """
from engine.mlx.device import MLXThread

def test_opens_a_thread_and_closes_it():
    dev = MLXThread(name="ember-mlx-closed")
    dev.call(lambda: None)
    dev.close()
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("EMBER_NO_OPENBLAS", "1")  # no re-exec of the inner run
    pytester.makeconftest(CONFTEST)
    return pytester


def test_a_module_that_leaves_an_engine_thread_running_fails_naming_it(inner):
    inner.makepyfile(test_leaky=LEAKY)
    result = inner.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_leaky.py left 1 engine thread(s) running*ember-mlx-leaked*"])


def test_a_module_that_closes_its_engine_thread_passes(inner):
    inner.makepyfile(test_closed=CLOSED)
    inner.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
