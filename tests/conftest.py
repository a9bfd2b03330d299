"""Shared test setup.

Async tests run on anyio's pytest plugin over asyncio with
``async_solipsism.EventLoop``: virtual time, a fixed ordering, and deadlock
detection. Tests that need real sockets or threads override ``anyio_backend``
in their module with plain "asyncio".
"""

from __future__ import annotations

import os

import async_solipsism
import pytest

from engine.mlx.blas import maybe_reexec_with_openblas, reexec_env


def pytest_configure(config):
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


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"loop_factory": async_solipsism.EventLoop})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    # A real pretrained model takes seconds to load and run: keep such tests out
    # of the fast lane (`pytest -m "not slow"`) without a second marker on each.
    for item in items:
        if item.get_closest_marker("real_model") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
