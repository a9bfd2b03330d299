"""Why a turn missed the cache, end to end: a live ``ember serve --model tiny``
and the official ``openai`` / ``anthropic`` clients. A turn that extends the
last one carries no ``cache_miss``; a turn whose earlier message was edited
carries one that names that message and shows both sides; Claude Code's
countdown (a ``system`` message after a tool result whose text changes each
turn) stays where it stands, so the next turn still hits the whole previous
prompt.

Each test has a server of its own: a conversation's first turn reports where
it left the closest other conversation of the namespace when the cache holds
one (docs/agent-api.md), and these first turns must find the cache empty."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.live_server import ember_serve

MODEL = "tiny"
pytestmark = pytest.mark.slow  # a server per test, real MLX compute


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with ember_serve("--model", MODEL, "--ssd-cache", str(tmp_path / "ssd")) as served:
        yield served


@pytest.fixture
def oai(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def ant(server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server[1], api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat_miss(r) -> dict | None:
    return r.usage.prompt_tokens_details.model_dump().get("cache_miss")


def conversation(tag: str, file: str) -> list[dict]:
    return [
        {"role": "system", "content": f"You are a terse coding agent ({tag})."},
        {"role": "user", "content": f"Please read the file {file} and summarise it."},
    ]


def test_chat_completions_edit_reports_the_message(oai, server):
    turn1 = conversation("chat", "alpha.py")
    r1 = oai.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8)
    assert chat_miss(r1) is None
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now list the tests."},
    ]
    r2 = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8)
    assert chat_miss(r2) is None
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens  # the whole last prompt
    turn3 = [turn2[0], {"role": "user", "content": "Please read the file omega.py and summarise it."}, *turn2[2:]]
    stream = oai.chat.completions.create(
        model=MODEL, messages=turn3, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    miss = usage.prompt_tokens_details.model_dump()["cache_miss"]
    assert (miss["message_index"], miss["message_role"], miss["tier"]) == (1, "user", "ram")
    assert miss["diverged_at"] == usage.prompt_tokens_details.cached_tokens
    assert miss["cached_tokens_available"] > usage.prompt_tokens_details.cached_tokens
    assert "omega" in miss["prompt_excerpt"] and "alpha" in miss["cached_excerpt"]
    assert "alpha" not in miss["prompt_excerpt"] and "omega" not in miss["cached_excerpt"]
    stats = httpx.get(f"{server[1]}/stats", timeout=10).json()["cache_misses"]
    assert stats["count"] >= 1 and stats["last"][-1] == miss


def test_messages_edit_reports_the_message(ant):
    system = "You are a terse coding agent (messages)."
    turn1 = [{"role": "user", "content": "Please read the file alpha.py and summarise it."}]
    r1 = ant.messages.create(model=MODEL, system=system, messages=turn1, max_tokens=8)
    assert r1.usage.model_dump().get("cache_miss") is None
    text = "".join(b.text for b in r1.content if b.type == "text")
    turn2 = turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "Now list the tests."}]
    r2 = ant.messages.create(model=MODEL, system=system, messages=turn2, max_tokens=8)
    assert r2.usage.model_dump().get("cache_miss") is None
    assert r2.usage.cache_read_input_tokens >= r1.usage.input_tokens + r1.usage.cache_read_input_tokens
    turn3 = [{"role": "user", "content": "Please read the file omega.py and summarise it."}, *turn2[1:]]
    r3 = ant.messages.create(model=MODEL, system=system, messages=turn3, max_tokens=8)
    miss = r3.usage.model_dump()["cache_miss"]
    # the rendered messages: the system prompt is message 0, the edited user turn message 1
    assert (miss["message_index"], miss["message_role"]) == (1, "user")
    assert miss["diverged_at"] == r3.usage.cache_read_input_tokens
    assert "omega" in miss["prompt_excerpt"] and "alpha" in miss["cached_excerpt"]


BASH = {"name": "bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}


def countdown_session(ant, system: str, turns: int, left: list[int]) -> list:
    """A Claude Code session of ``turns`` requests: each answer (the model's own
    text, sent back as it came, then a bash call) gets its tool result and the
    countdown system message of that turn; returns every response."""
    kw = {"model": MODEL, "system": system, "tools": [BASH], "max_tokens": 4}
    history: list[dict] = [{"role": "user", "content": "List the repository, one command at a time."}]
    out = []
    for i in range(turns):
        r = ant.messages.create(messages=history, **kw)
        out.append(r)
        text = "".join(b.text for b in r.content if b.type == "text")
        call = {"type": "tool_use", "id": f"t{i}", "name": "bash", "input": {}}
        history.append({"role": "assistant", "content": [{"type": "text", "text": text}, call]})
        history.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": f"f{i}"}]}
        )
        history.append({"role": "system", "content": f"<total_tokens>{left[i]} left</total_tokens>"})
    out.append(ant.messages.create(messages=history, **kw))
    out.append(history)
    return out


def test_claude_code_countdown_keeps_the_whole_previous_prompt(ant):
    system = "You are Claude Code (countdown)."
    *rs, history = countdown_session(ant, system, 2, [123000, 119500])
    for prev, r in zip(rs, rs[1:]):
        assert r.usage.model_dump().get("cache_miss") is None
        # every token of the last prompt, its countdown message included
        assert r.usage.cache_read_input_tokens >= prev.usage.input_tokens + prev.usage.cache_read_input_tokens
    # A client that rewrote the old countdown instead of appending a new one
    # would lose the cache from that message on: the report says which.
    rewritten = [dict(m) for m in history]
    first_countdown = next(i for i, m in enumerate(rewritten) if m["role"] == "system")
    rewritten[first_countdown]["content"] = "<total_tokens>118000 left</total_tokens>"
    r = ant.messages.create(model=MODEL, system=system, tools=[BASH], max_tokens=4, messages=rewritten)
    miss = r.usage.model_dump()["cache_miss"]
    assert miss["message_role"] == "system" and "118" in miss["prompt_excerpt"] and "123" in miss["cached_excerpt"]
    assert miss["diverged_at"] == r.usage.cache_read_input_tokens


def test_responses_usage_carries_the_miss(oai):
    first = oai.responses.create(model=MODEL, input="Please read the file alpha.py (responses).", max_output_tokens=8)
    assert first.usage.model_dump().get("cache_miss") is None
    again = oai.responses.create(model=MODEL, input="Please read the file omega.py (responses).", max_output_tokens=8)
    miss = again.usage.model_dump()["cache_miss"]
    assert "omega" in miss["prompt_excerpt"] and "alpha" in miss["cached_excerpt"]
