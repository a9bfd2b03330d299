"""The captured Claude Code session (tests/clients/fixtures/claude_code_session.json.xz):
12 real request bodies of Claude Code 2.1.332 (its default tools and system
prompt) reading 11 files one per turn through the scripted model, recorded
with tools/record_proxy.py; and how to replay one turn and read its usage."""

from __future__ import annotations

import json
import lzma
import pathlib
from typing import Any

import httpx

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def load_session(name: str = "claude_code_session") -> dict[str, Any]:
    return json.loads(lzma.decompress((FIXTURES / f"{name}.json.xz").read_bytes()))


def replay_turn(client: httpx.Client, url: str, turn: dict[str, Any]) -> dict[str, int]:
    """Send one recorded body unchanged; the usage Ember reported (message_start's, then message_delta's)."""
    headers = {"content-type": "application/json", "x-api-key": "dummy", "anthropic-version": "2023-06-01"}
    if turn.get("anthropic-beta"):
        headers["anthropic-beta"] = turn["anthropic-beta"]
    usage: dict[str, int] = {}
    with client.stream("POST", url + turn["path"], json=turn["body"], headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {r.read().decode()[:2000]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("type") == "message_start":
                usage.update(event["message"].get("usage") or {})
            elif event.get("type") == "message_delta":
                usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
    return usage


def prompt_tokens(usage: dict[str, int]) -> int:
    return (
        usage.get("input_tokens", 0)
        + usage.get("cache_read_input_tokens", 0)
        + usage.get("cache_creation_input_tokens", 0)
    )
