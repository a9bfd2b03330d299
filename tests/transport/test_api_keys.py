"""``--api-keys FILE`` (transport/wire/api_keys.py, issue #44): the file's rules,
its reload (a good edit takes effect, a bad one keeps the last good keys),
both headers, the admin key on the operator routes, per-key /metrics, and —
on the fake GPU, in process — that each key's prompt cache is its own.
The live, real-model checks (RAM and SSD tiers) are in test_key_isolation.py."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import httpx
import pytest

from ember import EngineConfig
from transport.server.http import build_app
from transport.wire.api_keys import ADMIN, KeysFile, KeysFileError, parse_keys

FAKE = EngineConfig(backend="fake", max_batch=4, max_queue=8, prefill_chunk=64)
KEYS = {ADMIN: "adm-0123456789", "alice": "al-0123456789", "bob": "bo-0123456789"}


def write(path: Path, obj: object, mtime_ns: int | None = None) -> None:
    """The file with ``obj`` as JSON; a distinct mtime, as a real edit a tick later would have."""
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize(
    "text,says",
    [
        ("not json", "not JSON"),
        ("[]", "non-empty JSON object"),
        ("{}", "non-empty JSON object"),
        ('{"alice": ""}', "non-empty string"),
        ('{"alice": 7}', "non-empty string"),
        ('{"alice": " padded "}', "without spaces"),
        ('{"al/ice": "k1"}', "key name"),
        ('{"": "k1"}', "key name"),
        ('{"alice": "same", "bob": "same"}', "same key"),
    ],
)
def test_a_bad_file_says_what_is_wrong(text, says):
    with pytest.raises(KeysFileError, match=says):
        parse_keys(text.encode())


def test_parse_gives_each_name_its_secret():
    assert parse_keys(json.dumps(KEYS).encode()) == {n: k.encode() for n, k in KEYS.items()}


def test_a_missing_or_bad_file_is_a_startup_error(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        KeysFile(str(tmp_path / "absent.json"))
    bad = tmp_path / "keys.json"
    write(bad, "{")
    with pytest.raises(KeysFileError, match="not JSON"):
        KeysFile(str(bad))


def test_reload_takes_a_good_edit_and_keeps_the_last_good_keys_on_a_bad_one(tmp_path, caplog):
    path = tmp_path / "keys.json"
    write(path, {"alice": "k-alice"}, mtime_ns=1_000_000_000)
    keys = KeysFile(str(path))
    assert keys.name_of(b"k-alice") == "alice" and keys.name_of(b"k-bob") is None

    write(path, {"alice": "k-alice2", "bob": "k-bob"}, mtime_ns=2_000_000_000)  # alice rotated, bob added
    assert keys.name_of(b"k-bob") == "bob"
    assert keys.name_of(b"k-alice") is None and keys.name_of(b"k-alice2") == "alice"
    assert keys.reloads == 1

    with caplog.at_level(logging.ERROR, logger="ember.keys"):
        write(path, '{"bob": ', mtime_ns=3_000_000_000)  # a half-written edit
        assert keys.name_of(b"k-bob") == "bob"  # still the last good keys
        assert keys.name_of(b"k-alice2") == "alice"
        keys.name_of(b"k-bob")  # unchanged since: not read (nor logged) again
    assert keys.reload_errors == 1
    assert [r.getMessage() for r in caplog.records if "reload failed" in r.getMessage()] != []
    assert len([r for r in caplog.records if "reload failed" in r.getMessage()]) == 1

    path.unlink()  # gone: logged once, the keys stay
    assert keys.name_of(b"k-bob") == "bob"
    assert keys.reload_errors == 2

    write(path, {"bob": "k-bob"}, mtime_ns=4_000_000_000)  # fixed: alice revoked
    assert keys.name_of(b"k-alice2") is None and keys.name_of(b"k-bob") == "bob"


def _auth(secret: str, header: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"} if header == "bearer" else {"x-api-key": secret}


@pytest.mark.anyio
async def test_named_keys_guard_the_routes_and_scope_the_cache(tmp_path):
    """Both headers name the key; the admin key alone reaches the operator
    routes; /metrics counts requests by key name (never the secret); and a
    prompt alice cached is a miss for bob, whose output is the same."""
    path = tmp_path / "keys.json"
    write(path, KEYS)
    app = build_app(FAKE, api_keys=KeysFile(str(path)), loopback_only=True)
    prompt = "a prompt long enough to be worth caching: " + "the quick brown fox " * 8
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as c:

            async def complete(name: str, header: str = "bearer") -> dict:
                r = await c.post("/v1/completions", json=body, headers=_auth(KEYS[name], header))
                assert r.status_code == 200, r.text
                return r.json()

            assert (await c.post("/v1/completions", json=body)).status_code == 401
            wrong = await c.post("/v1/completions", json=body, headers={"x-api-key": "nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

            first = await complete("alice", "bearer")
            again = await complete("alice", "x-api-key")  # the other header: the same key, the same cache
            other = await complete("bob", "x-api-key")
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert other["choices"][0]["text"] == first["choices"][0]["text"]

            for path_, method in (("/metrics", "GET"), ("/stats", "GET"), ("/admin/cache/flush", "POST")):
                kw = {"json": {}} if method == "POST" else {}
                r = await c.request(method, path_, headers=_auth(KEYS["bob"], "bearer"), **kw)
                assert r.status_code == 403, (path_, r.text)
                assert r.json()["error"]["code"] == "admin_key_required"
                r = await c.request(method, path_, headers=_auth(KEYS[ADMIN], "bearer"), **kw)
                assert r.status_code == 200, (path_, r.text)

            metrics = (await c.get("/metrics", headers=_auth(KEYS[ADMIN], "x-api-key"))).text
    assert 'ember_key_requests_total{key="alice",route="completions",status="200"} 2.0' in metrics
    assert 'ember_key_requests_total{key="bob",route="completions",status="200"} 1.0' in metrics
    assert not any(secret in metrics for secret in KEYS.values())


@pytest.mark.anyio
async def test_a_single_key_keeps_the_empty_namespace_and_every_route(tmp_path):
    """``--api-key``: one key, the cache every client shared before (no key
    names in /metrics), and /admin/* open to it."""
    app = build_app(FAKE, api_key="only-key-0123", loopback_only=True)
    body = {"prompt": "shared prefix for everyone " * 6, "max_tokens": 2}
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as c:
            for header in ("bearer", "x-api-key", "bearer"):
                r = await c.post("/v1/completions", json=body, headers=_auth("only-key-0123", header))
                assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert (
                await c.post("/admin/cache/flush", json={}, headers=_auth("only-key-0123", "bearer"))
            ).status_code == 200
            metrics = (await c.get("/metrics", headers=_auth("only-key-0123", "bearer"))).text
    assert "ember_key_requests_total{" not in metrics


@pytest.mark.anyio
async def test_a_stored_response_is_found_only_by_the_key_that_made_it(tmp_path):
    """``previous_response_id`` under named keys: bob cannot continue (or read)
    alice's stored conversation; he is told what anyone is told of an unknown id."""
    path = tmp_path / "keys.json"
    write(path, KEYS)
    app = build_app(FAKE, api_keys=KeysFile(str(path)), loopback_only=True)
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as c:
            turn1 = {"input": "hello", "store": True, "max_output_tokens": 3}
            r1 = await c.post("/v1/responses", json=turn1, headers=_auth(KEYS["alice"], "bearer"))
            assert r1.status_code == 200, r1.text
            turn2 = {"input": "more", "previous_response_id": r1.json()["id"], "max_output_tokens": 2}
            bob = await c.post("/v1/responses", json=turn2, headers=_auth(KEYS["bob"], "bearer"))
            assert bob.status_code == 400 and bob.json()["error"]["code"] == "previous_response_not_found"
            alice = await c.post("/v1/responses", json=turn2, headers=_auth(KEYS["alice"], "x-api-key"))
            assert alice.status_code == 200, alice.text


@pytest.mark.parametrize(
    "content,extra,says",
    [
        ('{"alice": ', [], "--api-keys: .* is not JSON"),
        (None, [], "--api-keys: cannot read the keys file"),
        ('{"alice": "k-alice"}', ["--api-key", "other"], "--api-key and --api-keys exclude each other"),
    ],
)
def test_a_bad_keys_flag_is_a_startup_error(tmp_path, monkeypatch, capsys, content, extra, says):
    from transport.cli import api_keys, build_parser

    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    parsed = build_parser().parse_args(["serve", "--fake-gpu", "--api-keys", str(path), *extra])
    with pytest.raises(SystemExit) as e:
        api_keys(parsed, parsed.parser)
    assert e.value.code == 2
    assert re.search(says, capsys.readouterr().err)


def test_the_environment_key_gives_way_to_the_keys_file(tmp_path, monkeypatch):
    from transport.cli import api_keys, build_parser

    monkeypatch.setenv("EMBER_API_KEY", "from-env")
    path = tmp_path / "keys.json"
    write(path, {"alice": "k-alice"})
    parsed = build_parser().parse_args(["serve", "--fake-gpu", "--api-keys", str(path)])
    keys = api_keys(parsed, parsed.parser)
    assert keys.name_of(b"k-alice") == "alice" and keys.name_of(b"from-env") is None
