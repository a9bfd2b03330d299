"""One request's deltas as server-sent events, with keep-alives, ending in
``data: [DONE]``, and aborted when the client goes away.

Starlette's ``StreamingResponse`` is not used: when the client disconnects
while its async generator is parked at a ``yield`` it does not close the
generator, so the request is cancelled only whenever garbage collection
finalizes it; and it cannot wait for the next token with a deadline (the
keep-alive). Here the disconnect watcher and the writer share one cancel
scope, and leaving ``async with stream`` is what cancels the request, at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ember.api import RequestStream
from engine.errors import EngineError
from engine.types import Delta

KEEPALIVE = b": keepalive\n\n"
DONE = b"data: [DONE]\n\n"


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class Renderer(Protocol):
    """Turns a request's deltas into SSE ``data:`` payloads of one API's shape."""

    def start(self) -> list[bytes]: ...

    def delta(self, d: Delta) -> list[bytes]: ...

    def error(self, exc: EngineError) -> list[bytes]: ...


class Disconnect:
    """Watches an ASGI ``receive`` (after the body was read) for the client leaving."""

    def __init__(self, receive: Receive):
        self.receive = receive
        self.happened = False

    async def cancel_on_disconnect(self, scope: anyio.CancelScope) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.happened = True
                scope.cancel()
                return


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        stream: RequestStream,
        renderer: Renderer,
        *,
        keepalive_s: float,
        on_tokens: Callable[[int, Any], Any] = lambda n, usage: None,
        on_end: Callable[[], Any] = lambda: None,
        send_timeout_s: float | None = None,
        on_usage: Callable[[Any], Awaitable[None]] | None = None,
    ):
        self.stream = stream
        self.on_usage = on_usage  # awaited with a finishing delta's usage before it is rendered
        self.send_timeout_s = send_timeout_s
        self.renderer = renderer
        self.keepalive_s = keepalive_s
        self.on_tokens = on_tokens
        self.on_end = on_end
        self.status_code = 200
        self.background = None
        # no-cache and no proxy buffering, or a proxy holds the tokens back
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.disconnected = False
        self.stalled = False  # the client stopped reading: aborted after ``send_timeout_s``

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnect = Disconnect(receive)
        async with self.stream:  # leaving early closes it: Cancel → Abort at the next step
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                tg.start_soon(disconnect.cancel_on_disconnect, tg.cancel_scope)
                try:
                    await self._write(send)
                except TimeoutError:
                    # A client that stops reading must not hold its admission
                    # slot until max_tokens: leaving ``async with stream``
                    # aborts the request; the unfinished response makes the
                    # server close the connection.
                    self.stalled = True
                tg.cancel_scope.cancel()
        self.disconnected = disconnect.happened
        if not self.disconnected and not self.stalled:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _write(self, send: Send) -> None:
        async def body(chunks: list[bytes]) -> None:
            if chunks:
                # a write waits while the socket's buffer is full (flow control): bounded
                with anyio.fail_after(self.send_timeout_s):
                    await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

        await body(self.renderer.start())
        while True:
            failed: EngineError | None = None
            try:
                d = self.stream.next_nowait()
            except EngineError as exc:
                d, failed = None, exc
            if d is None and failed is None:
                # Only the wait has a deadline: it is cancel-safe, the writes are not.
                if not await self.stream.wait(self.keepalive_s):
                    await body([KEEPALIVE])
                continue
            # Everything already queued goes out in one write.
            chunks: list[bytes] = []
            finished = False
            while d is not None:
                self.on_tokens(len(d.token_ids), d.usage)
                if d.usage is not None and self.on_usage is not None:
                    await self.on_usage(d.usage)
                chunks += self.renderer.delta(d)
                if d.finish_reason is not None and self.stream.finished:  # every choice's (n > 1)
                    finished = True
                    break
                try:
                    d = self.stream.next_nowait()
                except EngineError as exc:
                    d, failed = None, exc
            await body(chunks)
            if failed is not None:
                await body(self.renderer.error(failed))
                break
            if finished:
                self.on_end()
                break
        # OpenAI's streams end in [DONE]; a renderer whose API has no such line says `done = b""`.
        await body([getattr(self.renderer, "done", DONE)])
