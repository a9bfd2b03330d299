"""``ember serve`` in a subprocess on a free port, for tests that talk to it
over HTTP with real clients (the official SDKs): the live checks' launcher
(``sims.live.server``), with a failure to start as a test failure."""

from __future__ import annotations

import subprocess

from sims.live import server
from sims.live.server import ember_serve

__all__ = ["ember_serve", "read_url"]


def read_url(proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    """The URL ``ember serve`` prints once it is ready (it chose a free port itself)."""
    url = server.read_url(proc, timeout_s)
    if url is None:
        proc.kill()
        raise AssertionError(
            f"ember serve did not print its URL (rc={proc.wait()}): {proc.stderr.read() if proc.stderr else ''}"
        )
    return url
