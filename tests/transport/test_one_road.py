"""One road for every chat route (issue 44, transport/turn/road.py): each
generation route — chat completions, completions, Anthropic Messages, OpenAI
Responses — hands its request to ``road.run_turn``, and a per-request setting
(the operator's output cap, the send deadline, the cache namespace) reaches
the engine and the stream the same way on all four."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
from starlette.responses import Response

from tests.transport.test_http import FAKE, serving
from transport.turn import road
from transport.wire import request_io

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hello there"}]
ROUTES = [  # (path, body, the door's name)
    ("/v1/chat/completions", {"messages": USER}, "chat"),
    ("/v1/completions", {"prompt": "hello there"}, "completions"),
    ("/v1/messages", {"messages": USER}, "messages"),
    ("/v1/responses", {"input": "hello there"}, "responses"),
]
DOORS = [pathlib.Path(road.__file__).parents[1] / api / "api.py" for api in ("openai", "anthropic", "responses")]


async def test_every_generation_route_answers_from_the_road(monkeypatch):
    """With the road replaced, every route answers what the road answers: none has a path of its own."""
    doors: list[str] = []

    async def stand_in(request: Any, host: Any, route: road.ChatRoute) -> Response:
        doors.append(route.name)
        return Response(b"the road", status_code=203)

    monkeypatch.setattr(road, "run_turn", stand_in)
    async with serving() as (_, client):
        for path, body, _name in ROUTES:
            r = await client.post(path, json=body)
            assert (r.status_code, r.content) == (203, b"the road"), path
    assert doors == [name for _, _, name in ROUTES]


async def test_a_per_request_setting_reaches_every_route_alike(monkeypatch):
    """The operator's cap on an unset limit and the send deadline, on all four
    routes, streaming and not: one output limit at admission, one deadline on
    every stream, one cache namespace."""
    admitted: list[tuple[int, str]] = []
    real_submit = road.submit_choices

    async def submit_spy(engine: Any, prompt: list[int], params: list[Any], rename: Any, ns: str = "") -> Any:
        admitted.append((params[0].max_tokens, ns))
        return await real_submit(engine, prompt, params, rename, ns)

    deadlines: list[tuple[float | None, float]] = []
    real_stream = request_io.EventStream

    def stream_spy(*args: Any, **kw: Any) -> Any:
        deadlines.append((kw["send_timeout_s"], kw["keepalive_s"]))
        return real_stream(*args, **kw)

    monkeypatch.setattr(road, "submit_choices", submit_spy)
    monkeypatch.setattr(request_io, "EventStream", stream_spy)
    async with serving(FAKE, default_max_tokens=3, send_timeout_s=7.5, keepalive_s=11.0) as (_, client):
        for stream in (False, True):
            for path, body, _name in ROUTES:
                r = await client.post(path, json={**body, "stream": stream})
                assert r.status_code == 200, (path, r.text)
    assert admitted == [(3, "")] * 8
    assert deadlines == [(7.5, 11.0)] * 4


async def test_count_tokens_renders_the_prompt_messages_would_run():
    """``count_tokens`` takes the road's first half: the same prompt, nothing admitted."""
    seen: list[int] = []
    real_submit = road.submit_choices

    async def submit_spy(engine: Any, prompt: list[int], *args: Any) -> Any:
        seen.append(len(prompt))
        return await real_submit(engine, prompt, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(road, "submit_choices", submit_spy)
        async with serving() as (_, client):
            counted = await client.post("/v1/messages/count_tokens", json={"messages": USER})
            assert seen == []
            ran = await client.post("/v1/messages", json={"messages": USER, "max_tokens": 2})
    usage = ran.json()["usage"]
    assert counted.json()["input_tokens"] == seen[0] == usage["input_tokens"] + usage["cache_read_input_tokens"]


ROAD_STEPS = {
    "read_body",
    "request_namespace",
    "TokenTimer",
    "output_limit",
    "submit_choices",
    "submit",
    "tool_params",
    "respond",
    "event_stream",
    "collect",
    "thinking_kwargs",
}


@pytest.mark.parametrize("door", DOORS, ids=lambda p: p.parent.name)
def test_no_door_walks_a_step_of_the_road_itself(door: pathlib.Path):
    """A route module names none of the road's steps (it would be a second road)."""
    tree = ast.parse(door.read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    named |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert named & ROAD_STEPS == set()
