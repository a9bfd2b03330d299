"""Shared test setup.

Async tests run on anyio's pytest plugin over asyncio with
``async_solipsism.EventLoop``: virtual time, a fixed ordering, and deadlock
detection. Tests that need real sockets or threads override ``anyio_backend``
in their module with plain "asyncio".
"""

from __future__ import annotations

import async_solipsism
import pytest


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"loop_factory": async_solipsism.EventLoop})
