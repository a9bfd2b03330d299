"""The dashboard page's routes (transport/server/ui_routes.py) and the ring of recent
requests behind it (transport/wire/ui_stats.py), on the fake GPU; the page itself
runs in a browser in tests/browser/test_ui.py."""

from __future__ import annotations

from importlib import resources

import pytest
from starlette.testclient import TestClient

from engine.config import EngineConfig
from engine.types import SpecUsage, Usage
from transport.server.http import build_app
from transport.server.ui_routes import ASSETS, PATHS
from transport.wire.ui_stats import RecentRequests


def test_the_page_ships_as_package_data() -> None:
    ui = resources.files("transport").joinpath("ui")
    for name in ["index.html", *(file for file, _ in ASSETS.values())]:
        assert ui.joinpath(name).read_bytes(), name
    page = ui.joinpath("index.html").read_text()
    assert "http://" not in page and "https://" not in page  # no CDN: every file is this server's


def test_every_page_file_is_declared_package_data() -> None:
    """A wheel carries only what ``[tool.setuptools.package-data]`` names (checked
    on a built wheel too: `pip wheel . && unzip -l` lists transport/ui/*)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["transport"]
    files = [f"ui/{p.name}" for p in (root / "transport" / "ui").iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


@pytest.fixture
def client():  # type: ignore[no-untyped-def]
    with TestClient(
        build_app(EngineConfig(backend="fake"), api_key="k", loopback_only=True), base_url="http://127.0.0.1"
    ) as c:
        yield c


def test_page_loads_without_the_key_and_the_api_still_wants_it(client: TestClient) -> None:
    for path in ["/", "/ui"]:
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert '<script src="/ui/app.js"' in r.text
    assert client.head("/").status_code == 200  # clients probe it
    for path in PATHS:
        assert client.get(path).status_code == 200, path
    assert client.get("/ui/config.json").json() == {"api_key_required": True}
    assert client.get("/stats").status_code == 401
    assert client.get("/stats", headers={"authorization": "Bearer wrong"}).status_code == 401
    # the host check still guards the page (DNS rebinding)
    assert client.get("/", headers={"host": "attacker.example"}).status_code == 421


def test_recent_requests_reach_stats(client: TestClient) -> None:
    auth = {"authorization": "Bearer k"}
    assert client.get("/stats", headers=auth).json()["recent_requests"] == {"size": 64, "seq": 0, "requests": []}
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "stream": True}, headers=auth).status_code == 200
    recent = client.get("/stats", headers=auth).json()["recent_requests"]
    assert recent["seq"] == 2
    for rec in recent["requests"]:
        assert rec["ttft_ms"] is not None and rec["ttft_ms"] >= 0
        assert rec["prompt_tokens"] > 0 and rec["completion_tokens"] == 4
        assert rec["ssd_cached_tokens"] == 0  # no SSD tier here


def test_the_page_reads_the_pull_fields_health_returns(client: TestClient) -> None:
    """The dashboard's download rows (app.js ``renderPulls``) read ``/health``'s
    ``pulls``: every field it reads is one /health returns while a pull runs,
    so renaming one on either side fails here (the browser test shows the row)."""
    import re

    from engine.models import hub

    js = resources.files("transport").joinpath("ui", "app.js").read_text()
    assert 'fetch("/health")' in js and "body.pulls" in js
    render = js[js.index("function renderPulls") : js.index("async function pollPulls")]
    used = set(re.findall(r"\bp\.(\w+)", render))
    assert {"model", "done_bytes", "total_bytes"} <= used, used
    assert "pulls" not in client.get("/health").json()  # none running: the section stays hidden
    with hub._Pulling(hub.Progress("org/fake-model")) as progress:  # the registry a running pull fills
        progress.add(3 << 20, 12 << 20)
        (pull,) = client.get("/health").json()["pulls"]
    assert used <= set(pull), (used, pull)
    assert pull == {"model": "org/fake-model", "done_bytes": 3 << 20, "total_bytes": 12 << 20}


def test_ring_is_bounded_and_splits_the_tiers() -> None:
    ring = RecentRequests(size=3)
    spec = SpecUsage(drafted=5, accepted=3)
    for i in range(5):
        ring.add(
            0.01 * i,
            Usage(prompt_tokens=100, completion_tokens=8, cached_tokens=60, ssd_cached_tokens=40, speculation=spec),
        )
    ring.add(None, None)  # a request that produced nothing still counts
    snap = ring.snapshot()
    assert snap["seq"] == 6 and [r["seq"] for r in snap["requests"]] == [4, 5, 6]
    first = snap["requests"][0]
    assert first["ram_cached_tokens"] == 20 and first["ssd_cached_tokens"] == 40
    assert first["ttft_ms"] == 30.0 and (first["drafted"], first["accepted"]) == (5, 3)
    assert snap["requests"][-1]["ttft_ms"] is None
