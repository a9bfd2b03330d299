"""The scripted test model (engine.fake.scripted): its rules, and a live
server whose replies come from the script through the real tokenizer, chat
template, tool parser and prompt cache."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.fake.scripted import Script
from tests.live_server import ember_serve

TOOL = {
    "type": "function",
    "function": {"name": "Bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
}
SPEC = {
    "rules": [
        {
            "tools": True,
            "tool_results": 0,
            "text": "Let me look.",
            "tool_calls": [{"name": "Bash", "arguments": {"command": "cat f{{n}}.txt"}}],
        },
        {"tools": True, "min_tool_results": 1, "text": "It says: {{tool_result}} ({{n}} results)"},
        {"last_user": "^ping", "text": "pong"},
    ],
    "default": "default reply",
}


def _prompt(user: str, *, tools: bool = False, results: tuple[str, ...] = ()) -> str:
    text = "<|im_start|>system\n# Tools\n<tools>\n{}\n</tools><|im_end|>\n" if tools else ""
    text += f"<|im_start|>user\n{user}<|im_end|>\n"
    for r in results:
        text += f"<|im_start|>user\n<tool_response>\n{r}\n</tool_response><|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def test_rules_pick_the_reply_by_tool_results_and_user_text():
    s = Script(SPEC)
    call = s.reply(_prompt("go", tools=True))
    assert call.startswith("Let me look.\n<tool_call>\n")
    assert json.loads(call.split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == {
        "name": "Bash",
        "arguments": {"command": "cat f0.txt"},
    }
    assert s.reply(_prompt("go", tools=True, results=("A", "B-42"))) == "It says: B-42 (2 results)"
    assert s.reply(_prompt("ping me")) == "pong"
    assert s.reply(_prompt("hello")) == "default reply"


def test_a_bad_script_is_refused():
    with pytest.raises(ValueError, match="unknown script keys"):
        Script({"rulez": []})
    with pytest.raises(ValueError, match="rule 0"):
        Script({"rules": [{"when": 1}]})


@pytest.mark.slow
def test_served_tool_round_trip_hits_the_cache(tmp_path):
    """The reply is parsed back into a tool call by the real tool parser; the
    second turn's prompt reuses the first turn's cached prefix."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SPEC))
    with ember_serve("--model", f"scripted:{path}") as (_, url):
        msgs = [{"role": "user", "content": "go " * 3000}]  # a long prompt: the context is large and prefill is instant
        r1 = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "scripted", "messages": msgs, "tools": [TOOL]}, timeout=60
        )
        assert r1.status_code == 200, r1.text
        choice = r1.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "Bash"
        assert json.loads(call["function"]["arguments"]) == {"command": "cat f0.txt"}
        msgs += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "SECRET-9"}]
        r2 = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "scripted", "messages": msgs, "tools": [TOOL]}, timeout=60
        )
        assert r2.status_code == 200, r2.text
        body = r2.json()
        assert body["choices"][0]["message"]["content"] == "It says: SECRET-9 (1 results)"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1.json()["usage"]["prompt_tokens"] - 1
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert models[0]["id"] == "scripted"


def test_a_grammar_masks_the_script_as_it_masks_any_model(tmp_path):
    """A script that fits the grammar comes out as written; one that does not is
    bent into it (EOS where the grammar may end), never outside it."""
    from engine.fake.scripted import ScriptedBackend
    from engine.types import Constraint

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rules": [], "default": "x"}))
    b = ScriptedBackend(path)
    assert b.info.constraints and not b.info.logits_processing  # grammars only, no penalties/logprobs
    schema = Constraint(
        kind="json_schema", source=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    fits = b.tokenizer.encode_rendered('{"a":12}')
    assert [b._masked(schema, fits[:i], t) for i, t in enumerate(fits)] == fits
    assert b._masked(schema, fits, b._eos) == b._eos
    # the script wants to go on after the object closes: the grammar ends it
    assert b._masked(schema, fits, fits[0]) == b._eos
    # the script writes prose where JSON must start: a token the grammar allows instead
    prose = b.tokenizer.encode_rendered("Sure")[0]
    bent = b._masked(schema, [], prose)
    assert bent != prose and b.tokenizer.decode([bent]).startswith("{")
