"""What a caller holds while its request runs: ``RequestStream`` (one admitted
request's deltas, from ``Engine.asubmit``) and ``Completion`` (the collected
result of ``Engine.acomplete``/``complete``)."""

from __future__ import annotations

from typing import Any

import anyio

from actors.gateway import Cancel
from actors.runtime import Failure
from engine.errors import EngineDead, EngineError
from engine.types import Delta, TokenLogprob, Usage


class Completion:
    """The collected result of one request."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.usage = d.usage


class RequestStream:
    """One admitted request's deltas, from ``Engine.asubmit``.

    Receiving is cancel-safe (a timeout around ``__anext__`` loses no delta),
    so a server can wait for a token with a deadline and send a keep-alive
    instead. Closing the stream before the last delta cancels the request: the
    Gateway aborts its row at the next step.
    """

    def __init__(self, gateway: Any, rid: int, recv: Any):
        self.rid = rid
        self._gateway = gateway
        self._recv = recv
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.finished = True
            raise EngineDead("the request stream ended without a finish") from None
        return self._take(item)

    def next_nowait(self) -> Delta | None:
        """The next delta if one is already queued, else None; never waits.
        A writer that fell behind (a busy loop, many streams) drains what has
        piled up and sends it in one write instead of one per token."""
        if self.finished:
            return None
        try:
            item = self._recv.receive_nowait()
        except anyio.WouldBlock:
            return None
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.finished = True
            raise EngineDead("the request stream ended without a finish") from None
        return self._take(item)

    async def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the next delta (or the end) to be
        queued, without taking it: True if ``next_nowait``/``__anext__`` now
        answers at once. The keep-alive of a streaming server, without a cancel
        scope per token."""
        if self.finished:
            return True
        return await self._recv.wait(timeout)

    def _take(self, item: Any) -> Delta:
        if isinstance(item, Failure):
            self.finished = True
            raise item.exc
        if item.finish_reason is not None:
            self.finished = True
        return item

    async def aclose(self) -> None:
        self._recv.close()
        if not self.finished:
            self.finished = True
            try:
                self._gateway.tell_nowait(Cancel(rid=self.rid))
            except EngineError:
                pass

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
