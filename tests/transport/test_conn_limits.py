"""Connections and clients cannot hold capacity indefinitely (issue #23 item 8).

* A streaming client that stops reading: once a write has waited
  ``send_timeout_s`` the request is aborted and its admission slot is free
  (fake GPU, virtual time, the ASGI app driven by hand with a ``send`` that
  blocks the way a full socket buffer does).
* Slowloris: a real `ember serve --fake-gpu --header-timeout 1` closes a
  connection that never completes its request head, and one that never sends
  a byte, within the deadline (plus slack for a shared machine).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import anyio
import pytest

from ember import EngineConfig
from tests.live_server import read_url
from transport.server.http import build_app

FAKE = EngineConfig(backend="fake", max_batch=1, max_queue=0, prefill_chunk=64)


@pytest.mark.anyio
# a real loop: under virtual time a deadline can land within float noise of the
# clock, which async_solipsism then cannot reach (it spins)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_client_that_stops_reading_is_aborted_after_the_send_timeout():
    app = build_app(FAKE, send_timeout_s=0.5)
    async with app.router.lifespan_context(app):
        host = app.state.ember
        await host.settled.wait()
        body = b'{"prompt": "never read", "max_tokens": 32000, "stream": true, "ignore_eos": true}'
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await anyio.sleep_forever()  # the client never leaves, it just stops reading

        writes = 0
        status = []

        async def send(msg):
            nonlocal writes
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            if msg["type"] == "http.response.body":
                writes += 1
                if writes > 3:
                    await anyio.sleep_forever()  # the socket's buffer is full: flow control waits

        t0 = anyio.current_time()
        with anyio.fail_after(30):
            await app(scope, receive, send)
        waited = anyio.current_time() - t0
        assert status == [200] and writes == 4
        with anyio.fail_after(5):  # the Cancel reaches the Gateway, the Abort the Scheduler's next step
            while host.engine.stats()["gateway"]["in_flight"] or host.engine.stats()["scheduler"]["active_rows"]:
                await anyio.sleep(0.01)
        s = host.engine.stats()["scheduler"]
        print(f"generated {s['generated_tokens']} tokens before the abort")
        assert s["finished"] == 0 and s["generated_tokens"] < 32000
        print(f"\nthe stalled stream was aborted after {waited:.2f} s (send timeout 0.5 s), {writes} writes")
        assert 0.5 <= waited < 10.0
        # the slot is free: the next request is admitted (max_queue=0, max_batch=1)
        out = await host.engine.acomplete([1, 2, 3], None)
        assert out.token_ids


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (recv gives b""), or None."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return time.monotonic() - t0
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - t0


@pytest.mark.slow
def test_slowloris_and_silent_connections_are_closed_after_the_header_timeout():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transport.cli",
            "serve",
            "--fake-gpu",
            "--port",
            "0",
            "--header-timeout",
            "1",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = read_url(proc)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))
        dribble = socket.create_connection((host, int(port)))
        dribble.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t_silent = _closed_within(silent, 8)
        dribble.sendall(b"X-Slow: 1\r\n")
        t_dribble = _closed_within(dribble, 8)
        print(f"\nclosed after: silent {t_silent} s, dribbling {t_dribble} s (header timeout 1 s)")
        assert t_silent is not None and t_dribble is not None
        # a normal client is unaffected
        ok = socket.create_connection((host, int(port)))
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert ok.recv(4096).startswith(b"HTTP/1.1 200")
        for s in (silent, dribble, ok):
            s.close()
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
