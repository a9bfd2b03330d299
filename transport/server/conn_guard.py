"""A header-read deadline for uvicorn's connections (slowloris).

uvicorn closes a connection that idles after a response (``timeout_keep_alive``)
but sets no deadline before the first request, nor on headers that arrive a
byte at a time: 200 such connections were held 60 s in the issue's probe
(#23), each one a socket and a protocol object. Here every connection must
deliver a complete request head within ``header_timeout_s`` of opening, or of
its previous response completing; otherwise it is closed. Request bodies are
bounded by the body cap; a client that stops reading a stream is the send
timeout's business (``transport.wire.sse``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_head_timer()  # the next request's head is due in time too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": float(header_timeout_s)})
