"""A session sticks to one replica: ``ember launch`` gives each session a
routing key, sent by every client as ``X-SMG-Routing-Key``, the header the SGLang
Model Gateway's ``manual`` policy routes by (transport/server/launch.py; the real
clients were checked to send it: Claude Code's ``ANTHROPIC_CUSTOM_HEADERS``,
Codex's provider ``http_headers``, OpenCode's provider ``headers``). The
gateway half runs against the real sglang-router (marker ``cluster``)."""

from __future__ import annotations

import json
import pathlib
import tomllib

import httpx
import pytest

from sims.live.replicas import Cluster, router_available
from transport.server.launch import ROUTING_HEADER, client_env


def _keys(tmp_path, session=None) -> dict[str, str]:
    """The routing key each client is configured to send."""
    out = {}
    env = client_env("claude", "http://h:1", "m", 8192, {"ANTHROPIC_CUSTOM_HEADERS": "X-Team: a"}, tmp_path, session)
    lines = dict(h.split(": ", 1) for h in env["ANTHROPIC_CUSTOM_HEADERS"].splitlines())
    assert lines["X-Team"] == "a"  # the user's own headers stay
    out["claude"] = lines[ROUTING_HEADER]
    env = client_env("codex", "http://h:1", "m", 8192, {}, tmp_path, session)
    cfg = tomllib.loads((tmp_path / "codex" / "config.toml").read_text())
    out["codex"] = cfg["model_providers"]["ember"]["http_headers"][ROUTING_HEADER]
    env = client_env("opencode", "http://h:1", "m", 8192, {}, tmp_path, session)
    cfg = json.loads(pathlib.Path(env["OPENCODE_CONFIG"]).read_text())
    out["opencode"] = cfg["provider"]["ember"]["options"]["headers"][ROUTING_HEADER]
    return out


def test_each_launch_is_one_session_with_its_own_routing_key(tmp_path):
    assert set(_keys(tmp_path, "s-1").values()) == {"s-1"}
    a, b = _keys(tmp_path / "a"), _keys(tmp_path / "b")  # no key given: a fresh one per launch
    assert a["claude"] != b["claude"] and a["codex"] != b["codex"] and a["opencode"] != b["opencode"]


def _admitted(url: str) -> int:
    return int(httpx.get(url + "/stats", timeout=10).json()["scheduler"]["admitted"])


@pytest.mark.cluster
@pytest.mark.heavy  # two replicas and a gateway (~7 s): .ci/run's `pytest -m cluster` stage, not plain pytest
@pytest.mark.skipif(not router_available(), reason='needs sglang-router: pip install -e ".[cluster]"')
def test_the_gateway_keeps_a_routing_key_on_one_replica():
    """Two replicas behind the real gateway, ``--policy manual``: every request
    of a session (different prompts, so no prefix affinity could explain it)
    lands on one replica, and a second session's requests on one replica too."""
    # Cluster knows the policies it benchmarks; manual is given to the router directly (its last --policy wins)
    with Cluster(2, "round_robin", ["--fake-gpu", "--batch", "4"], router_args=["--policy", "manual"]) as c:
        for session in ("session-a", "session-b"):
            before = [_admitted(u) for u in c.replica_urls]
            for i in range(6):
                body = {"messages": [{"role": "user", "content": f"turn {i} of {session}"}], "max_tokens": 2}
                r = httpx.post(c.url + "/v1/chat/completions", json=body, headers={ROUTING_HEADER: session}, timeout=30)
                assert r.status_code == 200, r.text
            served = sorted(_admitted(u) - b for u, b in zip(c.replica_urls, before))
            assert served == [0, 6], (session, served)
