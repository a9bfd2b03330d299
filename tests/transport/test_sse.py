"""The SSE writer: deltas that piled up while the writer was busy go out in
one write, in order, and a stream ends with its finish, usage and [DONE]."""

from __future__ import annotations

import json

import anyio
import pytest

from actors.gateway import delta_stream
from ember.api import RequestStream
from engine.types import Delta, Usage
from transport.openai.render import CompletionRenderer
from transport.wire.sse import EventStream

pytestmark = pytest.mark.anyio


class _Gateway:
    def tell_nowait(self, msg):  # a Cancel after the finish is never sent here
        raise AssertionError(f"unexpected {msg!r}")


async def _never_disconnect():
    await anyio.sleep_forever()


def _events(body: bytes) -> list[str]:
    return [e[len("data: ") :] for e in body.decode().split("\n\n") if e.startswith("data: ")]


def _collector():
    """The body bytes of each write, and the ASGI ``send`` that collects them."""
    writes: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            writes.append(message["body"])

    return writes, send


async def _serve(stream: RequestStream) -> list[bytes]:
    writes, send = _collector()

    renderer = CompletionRenderer("m", include_usage=True)
    ended = []
    await EventStream(stream, renderer, keepalive_s=60, on_end=lambda: ended.append(True))(
        {"type": "http"}, _never_disconnect, send
    )
    assert ended == [True]
    return writes


async def test_queued_deltas_go_out_in_one_write():
    tx, rx = delta_stream()
    usage = Usage(prompt_tokens=3, completion_tokens=3)
    for i, text in enumerate(["a", "b"]):
        tx.send_nowait(Delta(rid=1, text=text, token_ids=[i]))
    tx.send_nowait(Delta(rid=1, text="c", token_ids=[2], finish_reason="length", usage=usage))
    writes = await _serve(RequestStream(_Gateway(), 1, rx))
    # the three deltas (and the usage chunk) in the first write, then [DONE]
    assert len(writes) == 2, writes
    events = _events(writes[0])
    texts = [json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"]]
    assert texts == ["a", "b", "c"]
    assert json.loads(events[-1])["usage"]["completion_tokens"] == 3
    assert _events(writes[1]) == ["[DONE]"]


async def test_a_writer_that_keeps_up_sends_each_delta_as_it_comes():
    tx, rx = delta_stream()

    async def produce():
        for i, text in enumerate(["a", "b", "c"]):
            await anyio.sleep(0.01)
            last = i == 2
            tx.send_nowait(
                Delta(
                    rid=1,
                    text=text,
                    token_ids=[i],
                    finish_reason="stop" if last else None,
                    usage=Usage(prompt_tokens=1, completion_tokens=3) if last else None,
                )
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        writes = await _serve(RequestStream(_Gateway(), 1, rx))
    assert [len(_events(w)) for w in writes] == [1, 1, 2, 1]  # a, b, c + usage, [DONE]


async def test_an_idle_stream_sends_keepalives_until_its_delta_comes():
    tx, rx = delta_stream()
    writes, send = _collector()

    async def produce():
        await anyio.sleep(0.25)  # five keep-alive periods with nothing to send
        tx.send_nowait(
            Delta(
                rid=1, text="a", token_ids=[0], finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1)
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        await EventStream(
            RequestStream(_Gateway(), 1, rx), CompletionRenderer("m", include_usage=True), keepalive_s=0.04
        )({"type": "http"}, _never_disconnect, send)
    keepalives = [w for w in writes if w == b": keepalive\n\n"]
    assert 3 <= len(keepalives) <= 7, writes
    assert writes.index(keepalives[-1]) < len(writes) - 2  # then the delta (+ usage), then [DONE]
    assert [json.loads(e)["choices"][0]["text"] for e in _events(writes[-2]) if json.loads(e)["choices"]] == ["a"]


async def test_a_cancelled_wait_loses_no_delta_and_leaves_no_waiter():
    tx, rx = delta_stream()
    stream = RequestStream(_Gateway(), 1, rx)
    with anyio.move_on_after(0.02):
        await stream.wait(60)
    assert rx._state.receiver is None
    assert await stream.wait(0.01) is False  # timed out: nothing queued
    tx.send_nowait(Delta(rid=1, text="a", token_ids=[5]))
    assert await stream.wait(60) is True  # already queued: no wait at all
    assert stream.next_nowait().token_ids == [5]


async def test_a_stream_that_ends_without_a_finish_fails_the_writer_not_hangs_it():
    tx, rx = delta_stream()
    writes, send = _collector()

    async def end():
        await anyio.sleep(0.02)
        tx.close()  # the engine died between tokens

    async with anyio.create_task_group() as tg:
        tg.start_soon(end)
        with anyio.fail_after(5):
            await EventStream(
                RequestStream(_Gateway(), 1, rx), CompletionRenderer("m", include_usage=True), keepalive_s=60
            )({"type": "http"}, _never_disconnect, send)
    body = b"".join(writes)
    assert b'"error"' in body and body.endswith(b"data: [DONE]\n\n"), body
