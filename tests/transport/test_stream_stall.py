"""``--send-timeout`` reaches every streaming route (issue #44 item 1).

A client that opens a stream and stops reading must not keep its batch slot
until max_tokens: once a write has waited ``--send-timeout`` the request is
aborted and the connection dropped. Each route builds its stream in one place
(``transport.wire.request_io.event_stream``); these tests hold every route to it
over a real socket.

The server is the scripted model (the fake GPU with a real tokenizer, fast)
whose reply is far longer than any socket buffer, with ``--batch 1`` so the
stalled request holds the only slot. A raw socket sends the request and never
reads; the kernel's buffers fill (about 2 MB on loopback: ~14k tokens, some
seconds), the server's write blocks, and after ``--send-timeout`` the request
is aborted. The next request must then be served long before the stalled one
could have finished on its own (``MAX_TOKENS`` tokens take minutes here), and
the stalled connection must have been closed without its stream's end.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

SEND_TIMEOUT_S = 1.0
MAX_TOKENS = 200_000  # ~1k tokens/s on the scripted model: minutes to finish on its own
SERVED = "stall"
# the longest a second request may wait: the buffers filling (seconds) plus the
# send timeout, with room for a loaded machine; far below MAX_TOKENS' time
SECOND_WAIT_S = 120.0

# route → (a streaming body that generates MAX_TOKENS, what ends its stream)
ROUTES = {
    # a plain completion continues a reply only after the template's generation prompt
    "/v1/completions": ({"prompt": "<|im_start|>assistant\n", "max_tokens": MAX_TOKENS}, b"data: [DONE]"),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "never read"}], "max_tokens": MAX_TOKENS},
        b"data: [DONE]",
    ),
    "/v1/messages": (
        {"model": SERVED, "messages": [{"role": "user", "content": "never read"}], "max_tokens": MAX_TOKENS},
        b"message_stop",
    ),
    "/v1/responses": ({"input": "never read", "max_output_tokens": MAX_TOKENS}, b"response.completed"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = Path(tmp_path_factory.mktemp("stall")) / "script.json"
    script.write_text(json.dumps({"default": "stall " * MAX_TOKENS}))
    flags = ["--model", f"scripted:{script}", "--served-model-name", SERVED, "--batch", "1", "--max-queue", "4"]
    flags += ["--send-timeout", str(SEND_TIMEOUT_S), "--no-ssd-cache"]
    with ember_serve(*flags) as (_, url):
        yield url


def scheduler(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        return json.load(r)["scheduler"]


def post(url: str, path: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


def stalled_client(url: str, path: str, body: dict) -> socket.socket:
    """Send a streaming request and never read its answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small: the buffers fill sooner
    sock.connect((host, int(port)))
    data = json.dumps({**body, "stream": True}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def drain(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the server sent, and whether it closed the connection."""
    sock.settimeout(timeout_s)
    got = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except TimeoutError:
        return bytes(got), False
    except ConnectionResetError:
        pass
    return bytes(got), True


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_stalled_stream_is_dropped_and_its_slot_serves_the_next_request(server: str, path: str) -> None:
    body, end = ROUTES[path]
    before = scheduler(server)
    sock = stalled_client(server, path, body)
    try:
        t0 = time.monotonic()
        while scheduler(server)["admitted"] == before["admitted"]:  # the stalled request holds the one slot
            assert time.monotonic() - t0 < 30, "the stalled request was never admitted"
            time.sleep(0.05)
        # the slot is the stalled request's until it is aborted: this one waits for that
        short = {**body, "max_output_tokens": 3} if path == "/v1/responses" else {**body, "max_tokens": 3}
        answer = post(server, path, short, SECOND_WAIT_S)
        waited = time.monotonic() - t0
        after = scheduler(server)
        received, closed = drain(sock, 30)
    finally:
        sock.close()
    print(
        f"\n{path}: the next request was served {waited:.1f} s after the stall began (send timeout {SEND_TIMEOUT_S} s)"
    )
    assert answer  # a whole answer, after the stalled request left the slot
    assert after["aborted"] == before["aborted"] + 1, after
    assert after["finished"] == before["finished"] + 1, after  # the short one; the stalled one never finished
    assert after["generated_tokens"] - before["generated_tokens"] < MAX_TOKENS
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert closed, "the server kept the stalled connection open"
    assert end not in received, "the stalled stream was finished, not dropped"
