"""Starting ``ember serve`` for the live checks and the tests that talk to a
real server: the command line, and the URL it prints once it is ready (it
picks a free port itself with ``--port 0``). One launcher, where each live
check had its own copy of the ready-line reader.

The module, not the console script: the script may not be on PATH in a venv
that was never activated (tests run .venv/bin/pytest)."""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator

READY = "ember: serving"  # transport.cli's ready line: "ember: serving MODEL at URL ..."


def ember_argv() -> list[str]:
    """``ember`` as this interpreter runs it."""
    return [sys.executable, "-m", "transport.cli"]


def serve_command(*flags: str, port: int | str = 0, log_level: str | None = "warning") -> list[str]:
    """``ember serve FLAGS --port PORT [--log-level LEVEL]``."""
    cmd = [*ember_argv(), "serve", *flags, "--port", str(port)]
    return cmd + (["--log-level", log_level] if log_level is not None else [])


def serving_url(line: str) -> str | None:
    """The URL in the server's ready line; None for any other line."""
    if not line.startswith(READY) or " at " not in line:
        return None
    return line.split(" at ", 1)[1].split()[0]


def read_url(proc: subprocess.Popen[str], timeout_s: float) -> str | None:
    """Read the server's stdout (a text pipe) up to its ready line and return
    the URL; None when the output ends or ``timeout_s`` passes first."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sel.select(timeout=deadline - time.monotonic()):
        line = proc.stdout.readline()
        if not line:
            return None
        url = serving_url(line)
        if url is not None:
            return url
    return None


def stop(proc: subprocess.Popen[str], grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; close the pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


@contextlib.contextmanager
def ember_serve(*flags: str, timeout_s: float = 60) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``ember serve FLAGS --host 127.0.0.1 --port 0``; yield the process and
    the URL it printed once ready; stop it (SIGTERM, then SIGKILL after 30 s)."""
    argv = serve_command(*flags, "--host", "127.0.0.1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = read_url(proc, timeout_s)
        if url is None:
            proc.kill()
            raise AssertionError(
                f"ember serve did not print its URL (rc={proc.wait()}): {proc.stderr.read() if proc.stderr else ''}"
            )
        yield proc, url
    finally:
        stop(proc)
