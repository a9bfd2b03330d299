"""Keys that isolate (issue #44), on a live ``ember serve --model tiny
--api-keys FILE``: a long prompt alice sent twice is a cache hit for her the
second time and a miss for bob, whose greedy output is the same; with
``--ssd-cache`` a prefix alice stored survives a restart for her and is a
miss for bob. The cache-hit count is ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

KEYS = {"admin": "adm-7f3e1c9a", "alice": "al-2b8d4e6f", "bob": "bo-9c1a7e3d"}
# Long enough that its prefix is worth caching on any tokenizer (--min-cached-prefix is 16 tokens).
PROMPT = "Summarise the following notes in one line. " + " ".join(
    f"Note {i}: the build on runner {i % 7} took {10 + i} minutes." for i in range(24)
)


def _keys_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


def _ask(c: httpx.Client, name: str, header: str = "bearer") -> dict:
    auth = {"authorization": f"Bearer {KEYS[name]}"} if header == "bearer" else {"x-api-key": KEYS[name]}
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
    r = c.post("/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _admin(c: httpx.Client) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS['admin']}"}


def test_a_prefix_alice_cached_is_a_miss_for_bob(tmp_path):
    with ember_serve("--model", "tiny", "--no-ssd-cache", "--api-keys", _keys_file(tmp_path)) as (_, url):
        with httpx.Client(base_url=url, timeout=120) as c:
            first = _ask(c, "alice")
            again = _ask(c, "alice", "x-api-key")
            other = _ask(c, "bob")
            assert _cached(first) == 0
            assert _cached(again) > 0, again["usage"]
            assert _cached(other) == 0, other["usage"]
            text = first["choices"][0]["message"]["content"]
            assert other["choices"][0]["message"]["content"] == text == again["choices"][0]["message"]["content"]
            assert c.get("/metrics", headers={"x-api-key": KEYS["bob"]}).status_code == 403
            metrics = c.get("/metrics", headers=_admin(c)).text
    assert 'ember_key_requests_total{key="alice",route="chat",status="200"} 2.0' in metrics
    assert 'ember_key_requests_total{key="bob",route="chat",status="200"} 1.0' in metrics


def test_the_ssd_tier_keeps_alices_prefix_across_a_restart_and_not_for_bob(tmp_path):
    flags = ("--model", "tiny", "--ssd-cache", str(tmp_path / "ssd"), "--api-keys", _keys_file(tmp_path))
    with ember_serve(*flags) as (_, url):
        with httpx.Client(base_url=url, timeout=120) as c:
            stored = _ask(c, "alice")
            flushed = c.post("/admin/cache/flush", json={}, headers=_admin(c))
            assert flushed.status_code == 200, flushed.text  # on SSD, renamed and fsynced
    with ember_serve(*flags) as (_, url):  # a new process: RAM is empty, only the SSD tier remembers
        with httpx.Client(base_url=url, timeout=120) as c:
            bob = _ask(c, "bob")
            alice = _ask(c, "alice")
            recent = c.get("/stats", headers=_admin(c)).json()["recent_requests"]["requests"]
    assert _cached(bob) == 0, bob["usage"]
    assert _cached(alice) > 0, alice["usage"]
    assert recent[-1]["ssd_cached_tokens"] == _cached(alice)  # restored from SSD, not RAM
    assert alice["choices"][0]["message"]["content"] == stored["choices"][0]["message"]["content"]
    assert bob["choices"][0]["message"]["content"] == stored["choices"][0]["message"]["content"]
