"""bench/agent_replay.py: the Messages -> chat-completions converter, the fixture and the report."""

from __future__ import annotations

import json

from bench.agent_replay import Turn, load_session, report, to_chat, to_ember


def test_to_chat_maps_system_tool_use_tool_result_and_tools():
    body = {
        "model": "claude",
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "an agent.", "cache_control": {}}],
        "messages": [
            {"role": "user", "content": "Read a.txt"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.txt"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "A!"}]},
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "mid-session note"}]},
        ],
        "tools": [{"name": "Read", "description": "read a file", "input_schema": {"type": "object", "properties": {}}}],
        "thinking": {"type": "enabled"},
        "max_tokens": 32000,
    }
    out = to_chat(body, "m", 64)
    assert out["model"] == "m" and out["max_tokens"] == 64 and out["temperature"] == 0.0 and out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}
    assert out["messages"] == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Read a.txt"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Read", "arguments": '{"file_path": "a.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "A!"},
        {"role": "user", "content": "and now?"},
        {"role": "system", "content": "mid-session note"},
    ]
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Read",
                "description": "read a file",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    assert "thinking" not in out


def test_the_fixture_is_a_real_session_and_converts_whole():
    session = load_session()
    turns = session["turns"]
    assert len(turns) >= 10
    assert session["client"].startswith("claude-code")
    prev_calls = -1
    for t in turns:
        body = t["body"]
        assert [x["name"] for x in body["tools"] if "input_schema" in x and x["name"] == "Read"] == ["Read"]
        chat = to_chat(body, "m", 64)
        calls = sum(len(m.get("tool_calls", [])) for m in chat["messages"])
        results = sum(m["role"] == "tool" for m in chat["messages"])
        assert calls == results > prev_calls  # every turn adds one Read and its result
        prev_calls = calls
        assert to_ember(body, "m", 64)["messages"] == body["messages"]  # Ember gets the body as recorded
    assert prev_calls >= 10
    last = json.dumps(to_chat(turns[-1]["body"], "m", 64))
    assert "f10.txt" in last and "notes file 10" in last  # the last tool result is there


def test_report_has_per_turn_rows_totals_shares_and_dashes():
    e = [Turn(100, 0, 1.0), Turn(150, 100, 0.2)]
    m = [Turn(80, 0, 0.5), Turn(120, None, 0.4)]
    text = report([{"ember": e, "mlx-lm": m}], ["Command: `x`"], restart_after=1)
    lines = text.splitlines()
    assert lines[0] == "Command: `x`"
    row1 = next(line for line in lines if line.startswith("| 1 |"))
    row2 = next(line for line in lines if line.startswith("| 2 (after restart) |"))
    assert "| 100 | 0 | 0.0% | 1000 |" in row1 and row1.endswith("| 2.00 |")
    assert "| 150 | 100 | 66.7% | 200 |" in row2 and "| 120 | — | — | 400 |" in row2 and row2.endswith("| 0.50 |")
    total = next(line for line in lines if line.startswith("| **total**"))
    assert "| 250 | 100 | 40.0% | 1200 |" in total and "| 200 | — | — | 900 |" in total and total.endswith("| 1.33 |")
    assert "Ember 200 ms, mlx-lm 400 ms" in text and "ratio Ember/mlx-lm 1.25" in text
