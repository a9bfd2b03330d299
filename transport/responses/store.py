"""The Responses API's stored responses, for ``previous_response_id``.

A response made with ``store: true`` is kept here as the whole conversation it
ended: the items of its chain's earlier turns, its own input items and its
output items, as JSON-ready dicts (``instructions`` are not carried over, as
on OpenAI's API: each request sends its own). A later request naming it with
``previous_response_id`` renders those items before its own input, so the
prompt is token for token the one the full conversation would make, and the
prompt cache finds the previous turn (transport/responses/api.py).

Bounded in memory: at most ``max_responses`` entries and ``max_bytes`` of
item JSON, least recently used first out. An unknown or evicted id is a 404
(``previous_response_not_found``) that says to resend the conversation as
input items, never a silent fresh start. Process memory only: a restart
forgets every response (clients that chain turns — the Agents SDK with
``previous_response_id``, Codex does not — then resend).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 256 << 20


class ResponseNotFound(KeyError):
    pass


def stored_id(ns: str, rid: str) -> str:
    """The store's key for response ``rid`` made in cache namespace ``ns``: a
    response is found only by requests of the key that made it (the empty
    namespace keeps the bare id)."""
    return f"{ns}\0{rid}" if ns else rid


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()  # id → (items JSON, its size)
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def put(self, rid: str, items: list[dict[str, Any]]) -> bool:
        """Keep ``items`` (the conversation so far) under ``rid``; False when one
        response alone is over the byte bound (it is not kept)."""
        blob = _encode(items)
        if len(blob) > self.max_bytes:
            return False
        self.drop(rid)
        self._items[rid] = (blob, len(blob))
        self.bytes += len(blob)
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.bytes -= size
            self.evicted += 1
        return True

    def get(self, rid: str) -> list[dict[str, Any]]:
        """The conversation stored under ``rid`` (a fresh copy); ``ResponseNotFound``."""
        got = self._items.get(rid)
        if got is None:
            raise ResponseNotFound(rid)
        self._items.move_to_end(rid)
        return msgspec.json.decode(got[0])

    def drop(self, rid: str) -> bool:
        got = self._items.pop(rid, None)
        if got is None:
            return False
        self.bytes -= got[1]
        return True

    def stats(self) -> dict[str, int]:
        return {"responses": len(self._items), "bytes": self.bytes, "evicted": self.evicted}
