"""Browsers must not drive the server (issue #23 item 5): the matrix of
Content-Type × Host × API key over every kind of route, against the app on
the fake GPU; and once through a real `ember serve` process (flag, env var,
loopback Host on a real socket).

The expected status of each cell is computed from the rules, in order: a
non-loopback Host → 421 (loopback bind only); no or a wrong key → 401 (key
set; /health is public); POST without application/json → 415; else the
route's own answer.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import httpx
import pytest

from ember import EngineConfig
from tests.live_server import read_url
from transport.server.http import build_app
from transport.server.security import host_name, is_loopback

KEY = "s3cret-key"
FAKE = EngineConfig(backend="fake", max_batch=4, max_queue=8, prefill_chunk=64)

CTYPES = {
    "json": "application/json",
    "json-charset": "application/json; charset=utf-8",
    "text": "text/plain",
    "form": "application/x-www-form-urlencoded",
    "multipart": "multipart/form-data; boundary=x",
    "none": None,
}
HOSTS = {
    "ipv4": ("127.0.0.1:8000", True),
    "localhost": ("localhost", True),
    "localhost-port": ("localhost:1234", True),
    "ipv6": ("[::1]:8000", True),
    "attacker": ("attacker.example", False),
    "attacker-port": ("attacker.example:8000", False),
    "rebound-ip-lookalike": ("127.0.0.1.nip.io", False),
    "lan": ("192.168.1.5:8000", False),
}
KEYS = {
    "none": {},
    "wrong": {"authorization": "Bearer nope"},
    "bearer": {"authorization": f"Bearer {KEY}"},
    "x-api-key": {"x-api-key": KEY},
}
ROUTES = [
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', 200),
    ("POST", "/admin/cache/flush", b"", 200),  # privileged: no SSD tier here, an empty durable report
    (
        "POST",
        "/v1/messages",
        b"{}",
        400,
    ),  # Anthropic Messages: past the guard, the route's own 400 for a body without messages
    ("POST", "/v1/route-added-later", b"{}", 404),  # the guard runs before routing: it covers routes added later
    ("GET", "/v1/models", None, 200),
    ("GET", "/health", None, 200),
]


def expected(
    method: str, path: str, ok: int, ctype: str | None, host_ok: bool, key: str, *, with_key: bool, loopback: bool
) -> int:
    if loopback and not host_ok:
        return 421
    if with_key and path != "/health" and key not in ("bearer", "x-api-key"):
        return 401
    if method == "POST" and (ctype is None or not ctype.startswith("application/json")):
        return 415
    return ok


@pytest.mark.anyio
@pytest.mark.parametrize("with_key,loopback", [(True, True), (False, True), (True, False), (False, False)])
async def test_content_type_host_and_api_key_matrix(with_key, loopback):
    app = build_app(FAKE, api_key=KEY if with_key else None, loopback_only=loopback)
    cells = 0
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            for (method, path, body, ok), (cname, ctype), (hname, (host, host_ok)), (kname, kh) in itertools.product(
                ROUTES, CTYPES.items(), HOSTS.items(), KEYS.items()
            ):
                if method == "GET" and cname != "none":
                    continue
                headers = {"host": host, **kh}
                if ctype is not None:
                    headers["content-type"] = ctype
                r = await client.request(method, path, content=body, headers=headers)
                want = expected(method, path, ok, ctype, host_ok, kname, with_key=with_key, loopback=loopback)
                assert r.status_code == want, (method, path, cname, hname, kname, r.text)
                if want in (401, 415, 421):
                    err = r.json()["error"]
                    assert (
                        err["code"] in ("invalid_api_key", "unsupported_media_type", "invalid_host") and err["message"]
                    )
                    if want == 401:
                        assert r.headers["www-authenticate"] == "Bearer"
                cells += 1
    assert cells == 4 * 6 * 8 * 4 + 2 * 8 * 4


def test_loopback_names():
    assert all(
        is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]", "LOCALHOST", "a.localhost")
    )
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "attacker.example", "127.0.0.1.nip.io", "10.0.0.1", ""))
    assert [host_name(v) for v in ("[::1]:80", "localhost:8000", "127.0.0.1", "[::1]")] == [
        "[::1]",
        "localhost",
        "127.0.0.1",
        "[::1]",
    ]


@pytest.mark.slow
def test_ember_serve_takes_the_key_from_the_flag_or_the_environment():
    """A real process and socket: EMBER_API_KEY is honoured, the key guards
    /v1 routes but not /health, and a rebinding Host is refused."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EMBER_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "transport.cli", "serve", "--fake-gpu", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = read_url(proc)
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
            r = c.post(
                "/v1/completions",
                content=b'{"prompt": "hi", "max_tokens": 2}',
                headers={"authorization": f"Bearer {KEY}", "content-type": "text/plain"},
            )
            assert r.status_code == 415
            assert c.get("/health", headers={"host": "attacker.example"}).status_code == 421
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
