"""bench/agent_tasks: the judges, the wire reader and proxy, the attribution and the report (no client, no model)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from bench.agent_tasks.attribute import Session, ember_faults, judge_session, named_tool_in_text, session_from_dict
from bench.agent_tasks.clients import CLIENTS, client_args, client_env, scripted_call
from bench.agent_tasks.report import counts_table, report, sessions_table
from bench.agent_tasks.run import write_solving_script
from bench.agent_tasks.tasks import BY_NAME, TASKS, make_repo
from bench.agent_tasks.wire import Exchange, Recorder, StreamReader, ToolCall, proxy_app


def _sse(*events: tuple[str, dict]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


ANTHROPIC_CALL = _sse(
    ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 900, "output_tokens": 0}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Ok"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "content_block_start",
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "name": "Bash", "id": "t"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"comm'}},
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": 'and": "ls"}'},
        },
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"input_tokens": 100, "cache_read_input_tokens": 800, "output_tokens": 12},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)


def _read(api: str, body: bytes, chunk: int = 7, stream: bool = True) -> Exchange:
    ex = Exchange("POST", "/x", 0.0, api=api, stream=stream, status=200)
    r = StreamReader(ex)
    for i in range(0, len(body), chunk):  # events split anywhere, as TCP splits them
        r.feed(body[i : i + chunk])
    r.close()
    return ex


def test_anthropic_stream_gives_the_call_text_usage_and_end():
    ex = _read("anthropic", ANTHROPIC_CALL)
    assert ex.ended == "complete" and ex.stop_reason == "tool_use" and ex.text == "Ok"
    assert [(c.name, json.loads(c.arguments)) for c in ex.tool_calls] == [("Bash", {"command": "ls"})]
    assert (ex.prompt_tokens, ex.cached_tokens, ex.output_tokens) == (900, 800, 12)


def test_chat_stream_joins_call_deltas_and_reads_usage():
    chunks = [
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "bash", "arguments": '{"com'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'mand": "ls"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}},
        },
    ]
    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    ex = _read("chat", body, chunk=5)
    assert ex.ended == "complete" and ex.stop_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in ex.tool_calls] == [("bash", '{"command": "ls"}')]
    assert (ex.prompt_tokens, ex.cached_tokens) == (50, 32)


def test_responses_stream_reads_function_and_custom_calls():
    body = _sse(
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hm"}),
        (
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "item": {"type": "function_call", "name": "exec_command", "arguments": "{}"},
            },
        ),
        (
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "item": {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin"},
            },
        ),
        (
            "response.completed",
            {
                "type": "response.completed",
                "response": {"usage": {"input_tokens": 70, "input_tokens_details": {"cached_tokens": 60}}},
            },
        ),
    )
    ex = _read("responses", body)
    assert ex.ended == "complete" and ex.text == "hm"
    assert [(c.name, c.custom) for c in ex.tool_calls] == [("exec_command", False), ("apply_patch", True)]
    assert all(c.well_formed() for c in ex.tool_calls)
    assert (ex.prompt_tokens, ex.cached_tokens) == (70, 60)


def test_a_stream_without_its_end_event_stays_open():
    ex = _read("anthropic", ANTHROPIC_CALL.rsplit(b"event: message_stop", 1)[0])
    assert ex.ended == "open"  # the proxy calls that "truncated" (below)


def _upstream() -> Starlette:
    async def messages(request: Request) -> Response:
        body = await request.json()
        if body.get("max_tokens") == 1:
            return JSONResponse({"type": "error", "error": {"message": "boom"}}, status_code=500)
        cut = body.get("max_tokens") == 2  # a stream the server ends before message_stop
        data = ANTHROPIC_CALL.rsplit(b"event: message_stop", 1)[0] if cut else ANTHROPIC_CALL
        return Response(data, media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m", "context_length": 4096}]})

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]), Route("/v1/models", models)])


def test_the_proxy_forwards_and_records_status_tools_and_truncation():
    rec = Recorder()
    app = proxy_app("http://upstream", rec, transport=httpx.ASGITransport(app=_upstream()))
    tools = [{"name": "Bash", "input_schema": {}}, {"name": "Read", "input_schema": {}}]
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        ok = client.post("/v1/messages", json={"stream": True, "max_tokens": 64, "tools": tools})
        assert ok.status_code == 200 and ok.content == ANTHROPIC_CALL  # forwarded byte for byte
        assert client.post("/v1/messages", json={"stream": True, "max_tokens": 1}).status_code == 500
        client.post("/v1/messages", json={"stream": True, "max_tokens": 2})
    models, good, failed, cut = rec.exchanges
    assert not models.is_turn and good.is_turn
    assert good.ended == "complete" and good.tools_offered == ["Bash", "Read"] and good.max_output == 64
    assert [c.name for c in good.tool_calls] == ["Bash"]
    assert failed.status == 500 and "boom" in failed.error_body
    assert cut.ended == "truncated"
    faults = ember_faults(rec.exchanges)
    assert len(faults) == 2 and faults[0].startswith("HTTP 500") and faults[1].startswith("truncated stream")


def _turn(**kw: Any) -> Exchange:
    base: dict[str, Any] = {"method": "POST", "path": "/v1/messages", "t_start": 0.0, "api": "anthropic"}
    base.update(status=200, ended="complete", tools_offered=["Bash", "Write"], lineage="L")
    base.update(kw)
    return Exchange(**base)


def test_a_call_written_as_text_is_embers_fault_only_when_it_names_an_offered_tool():
    fenced = 'I will run:\n```json\n{"name": "Bash", "arguments": {"command": "ls"}}\n```'
    assert named_tool_in_text(fenced, ["Bash"]) == "Bash"
    assert named_tool_in_text('{"name": "Nope", "arguments": {}}', ["Bash"]) is None
    assert named_tool_in_text("no json {here", ["Bash"]) is None
    assert ember_faults([_turn(text=fenced)]) == ["call not parsed: text names 'Bash'"]
    # the same text beside a parsed call is the model's prose, not a lost call
    assert ember_faults([_turn(text=fenced, tool_calls=[ToolCall("Bash", "{}")])]) == []


def test_malformed_calls_and_a_lost_cache_are_embers_faults():
    bad = _turn(tool_calls=[ToolCall("Bash", '{"command": ')])
    assert ember_faults([bad])[0].startswith("malformed call 'Bash'")
    first = _turn(prompt_tokens=1000, cached_tokens=0)
    warm = _turn(prompt_tokens=1100, cached_tokens=990)
    cold = _turn(prompt_tokens=1200, cached_tokens=10)
    other = _turn(prompt_tokens=1300, cached_tokens=0, lineage="side request")
    assert ember_faults([first, warm, other]) == []
    assert ember_faults([first, warm, cold]) == ["cache lost: 10 of 1200 cached after a 1100"]
    # a stream the client left (the time cap) carries only message_start's usage: not final, not judged
    left = _turn(prompt_tokens=1300, cached_tokens=0, ended="client_gone")
    assert ember_faults([first, warm, left]) == []


def _session(passed: bool, exchanges: list[Exchange], timed_out: bool = False) -> Session:
    return judge_session(Session("claude", "m", "hello", passed, "no hello.py", 0, timed_out, 1.0, exchanges))


def test_a_failure_is_the_models_unless_ember_faulted_or_time_ran_out():
    called = _turn(tool_calls=[ToolCall("Write", '{"file_path": "x"}')])
    silent = _session(False, [_turn(text="I can't")])
    assert silent.outcome == "model" and silent.reason.startswith("no tool call")
    assert _session(False, [called]).reason.startswith("1 calls, wrong result")
    cut = _session(False, [called, _turn(ended="client_gone")], timed_out=True)
    assert cut.outcome == "time cap" and cut.reason.startswith("time cap: 1 of 2 turns finished, 1 calls")
    gave_up = _turn(ended="client_gone", t_end=300.0)
    retry = _session(False, [gave_up, _turn(t_start=301.0, ended="client_gone")], timed_out=True)
    assert retry.abandoned == 1 and "the client gave up on 1 and retried" in retry.reason
    broken = _session(False, [_turn(status=503, error_body="overloaded")])
    assert broken.outcome == "ember" and broken.reason == ""
    assert broken.ember == ["HTTP 503 POST /v1/messages: overloaded"]
    passed = _session(True, [called])
    assert passed.outcome == "pass" and passed.tool_calls == 1
    table = counts_table([passed, broken, _session(False, [called]), cut])
    assert "| claude | `m` | 1/4 | 1 | 1 | 1 | 1 |" in table
    header, rule, row = table.splitlines()
    assert header.count("|") == rule.count("|") == row.count("|")
    lines = sessions_table([cut]).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].replace("\\|", "").count("|")
    assert "## Ember's faults" in report([broken]) and "## Ember's faults" not in report([passed])


def test_a_saved_session_is_attributed_again_the_same(tmp_path):
    import dataclasses

    s = _session(False, [_turn(prompt_tokens=10, cached_tokens=0), _turn(text='{"name": "Bash", "arguments": {}}')])
    again = judge_session(session_from_dict(json.loads(json.dumps(dataclasses.asdict(s)))))
    assert again.ember == s.ember == ["call not parsed: text names 'Bash'"] and again.outcome == "ember"


def test_every_client_has_its_arguments_budget_and_shell_call():
    task = BY_NAME["secret"]
    for client in CLIENTS:
        assert task.prompt in client_args(client, task)
        tool, args = scripted_call(client, task)
        assert task.solve in args.values()
    assert client_env("claude", "m", 4096, 99) == {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "99"}
    opencode = json.loads(client_env("opencode", "m", 4096, 99)["OPENCODE_CONFIG_CONTENT"])
    assert opencode["provider"]["ember"]["models"]["m"]["limit"] == {"context": 4096, "output": 99}
    with pytest.raises(ValueError):
        client_args("cursor", task)


def test_the_solving_script_tells_sessions_apart_by_their_repository(tmp_path):
    repo = tmp_path / "claude" / "fix" / "repo"
    script = json.loads(write_solving_script(tmp_path / "s.json", [("claude", BY_NAME["fix"], repo)]).read_text())
    call, done = script["rules"]
    assert call["tool_calls"][0]["name"] == "Bash" and str(repo) in call["prompt"].replace("\\", "")
    assert done["min_tool_results"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", [t.name for t in TASKS])
def test_each_judge_fails_the_untouched_repo_and_passes_the_solution(tmp_path, name):
    task = BY_NAME[name]
    repo = make_repo(task, tmp_path / "repo")
    ok, detail = task.judge(repo)
    assert not ok, detail
    subprocess.run(["bash", "-c", task.solve], cwd=repo, check=True)
    ok, detail = task.judge(repo)
    assert ok, detail


@pytest.mark.slow
def test_the_fix_judge_refuses_an_edited_test(tmp_path):
    task = BY_NAME["fix"]
    repo = make_repo(task, tmp_path / "repo")
    (repo / "test_calc.py").write_text("def test_add():\n    assert True\n")
    ok, detail = task.judge(repo)
    assert not ok and "test_calc.py was changed" in detail
