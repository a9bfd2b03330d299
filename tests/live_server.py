"""``ember serve`` in a subprocess on a free port, for tests that talk to it
over HTTP with real clients (the official SDKs)."""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator


def read_url(proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    """The URL ``ember serve`` prints once it is ready (it chose a free port itself)."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sel.select(timeout=deadline - time.monotonic()):
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ember: serving"):
            return line.split(" at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError(
        f"ember serve did not print its URL (rc={proc.wait()}): {proc.stderr.read() if proc.stderr else ''}"
    )


@contextlib.contextmanager
def ember_serve(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``ember serve FLAGS --host 127.0.0.1 --port 0``; yield the process and
    the URL it printed once ready; stop it (SIGTERM, then SIGKILL after 30 s)."""
    argv = [sys.executable, "-m", "transport.cli", "serve", *flags]
    argv += ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc, read_url(proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
