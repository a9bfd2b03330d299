"""``ember serve`` in a subprocess on a free port, for tests that talk to it
over HTTP with real clients (the official SDKs)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from tests.test_openai_client import _read_url


@contextlib.contextmanager
def ember_serve(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``ember serve FLAGS --host 127.0.0.1 --port 0``; yield the process and
    the URL it printed once ready; stop it (SIGTERM, then SIGKILL after 30 s)."""
    argv = [sys.executable, "-m", "transport.cli", "serve", *flags]
    argv += ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc, _read_url(proc)
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
