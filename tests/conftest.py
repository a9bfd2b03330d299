"""Shared test setup.

Async tests run on anyio's pytest plugin over asyncio with
``async_solipsism.EventLoop``: virtual time, a fixed ordering, and deadlock
detection. Tests that need real sockets or threads override ``anyio_backend``
in their module with plain "asyncio".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import async_solipsism
import pytest

from engine.mlx.blas import maybe_reexec_with_openblas, reexec_env

KV_TMP_PREFIX = "ember-test-kv-"
_skip_log_here = True  # False on an xdist worker (pytest_configure)


def _is_xdist_worker(config) -> bool:
    # the README command runs the suite on pytest-xdist workers (pyproject addopts)
    return hasattr(config, "workerinput")


def pytest_configure(config):
    global _skip_log_here
    _skip_log_here = not _is_xdist_worker(config)  # the controller sees every worker's reports
    # `ember serve` keeps an SSD prompt cache under ~/.cache/ember/kv by default
    # (ember/ssd_tier.py): the suite's servers (in-process and the
    # subprocesses, which inherit the variable) write into a temp dir instead,
    # one per xdist worker, so two workers' servers never share a cache.
    inherited = os.environ.get("EMBER_KV_CACHE_DIR", "")
    if not inherited or (_is_xdist_worker(config) and os.path.basename(inherited).startswith(KV_TMP_PREFIX)):
        os.environ["EMBER_KV_CACHE_DIR"] = tempfile.mkdtemp(prefix=KV_TMP_PREFIX)
    # MLX's Linux CPU wheel links a reference BLAS; the MLX tests run several
    # times faster with OpenBLAS preloaded, which only works from process start.
    # So a plain `pytest` re-executes itself once with it (EMBER_NO_OPENBLAS=1
    # opts out). Capturing is stopped first so the new process owns the terminal.
    if reexec_env(os.environ) is None:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    maybe_reexec_with_openblas()


def pytest_unconfigure(config):
    path = os.environ.get("EMBER_KV_CACHE_DIR", "")
    if os.path.basename(path).startswith(KV_TMP_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"loop_factory": async_solipsism.EventLoop})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    # A real pretrained model (or a stress test) takes seconds: keep such tests out
    # of the fast lane (`pytest -m "not slow"`) without a second marker on each.
    for item in items:
        heavy = item.get_closest_marker("real_model") or item.get_closest_marker("stress")
        if heavy and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


# --- Leaks: an engine a test opens is closed by the end of its scope.
#
# An Engine (or ServerState, or a bare MLXThread) owns a thread named
# ``ember-mlx*`` that holds the model's weights and caches; one left running keeps
# its memory and its CPU for the rest of the run (a whole suite once grew to
# 8.7 GB this way). After the last test of each module, when the module-scoped
# fixtures are torn down too, a thread named ``ember-*`` that the module started
# and that is still alive fails that test's teardown, naming the thread.

LEAK_GRACE_S = 5.0  # a closed engine's thread finishes its last job and exits


def _ember_threads() -> dict[int, threading.Thread]:
    return {t.ident: t for t in threading.enumerate() if t.name.startswith("ember-") and t.ident is not None}


def leaked_threads(before: set[int], grace_s: float = LEAK_GRACE_S) -> list[str]:
    """Names of the ``ember-*`` threads alive now that were not alive in ``before``,
    after waiting up to ``grace_s`` for them to exit."""
    deadline = time.monotonic() + grace_s
    for ident, t in _ember_threads().items():
        if ident not in before:
            t.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for ident, t in _ember_threads().items() if ident not in before and t.is_alive())


_threads_at_module_start: dict[str, set[int]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _threads_at_module_start.setdefault(item.nodeid.split("::")[0], set(_ember_threads()))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    module = item.nodeid.split("::")[0]
    if nextitem is not None and nextitem.nodeid.split("::")[0] == module:
        return result
    before = _threads_at_module_start.pop(module, set())
    leaked = leaked_threads(before)
    if leaked:
        raise AssertionError(
            f"{module} left {len(leaked)} engine thread(s) running after its tests and fixtures "
            f"finished: {', '.join(leaked)}; close every Engine/ServerState/MLXThread it opens "
            "(async with Engine.open(...), or a fixture that closes it)"
        )
    return result


# --- Skips: with EMBER_SKIP_LOG set, every skipped test or module is written
# there with its reason (one JSON object a line); .ci/run fails on a reason that
# .ci/allowed-skips does not allow (.ci/check_skips.py).


def _log_skip(nodeid: str, longrepr) -> None:
    path = os.environ.get("EMBER_SKIP_LOG")
    if not path or not _skip_log_here:
        return
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": nodeid, "reason": reason}) + "\n")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _log_skip(report.nodeid, report.longrepr)


def pytest_collectreport(report):
    if report.skipped:
        _log_skip(report.nodeid, report.longrepr)
