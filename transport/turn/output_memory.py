"""The tokens a model generated, kept so the next turn's prompt reuses them.

An agent's next request re-renders the whole conversation through the chat
template and the server tokenizes the text again. The text of the previous
answer comes back unchanged (or, for a tool call, re-serialised to the same
text: see transport/turn/tools.py), but tokenizing it again need not give the ids
the model sampled: a model may spell "Paris" as "Par" + "is", and the
tokenizer's canonical split differs. The prompt cache matches ids, so from the
first such token on, the previous answer — and everything after it — would be
prefilled again.

So for each finished answer this keeps ``(prompt text + answer text) → (prompt
ids + answer ids)``; a new prompt whose text starts with a kept key takes those
ids and tokenizes only the rest. The split point is where the previous answer
ended, which in a rendered conversation is followed by the template's
end-of-turn marker, so the rest tokenizes as it would have in one piece. An
answer is kept only when its ids decode exactly to its text (not when a stop
string cut the text short of the ids). A session's older key is dropped when
its longer successor is kept; the whole memory is capped in characters.

Keys are scoped by the request's cache namespace (``scope``): under named API
keys one tenant's answers never tokenize another's prompt (the prompt token
count would say that someone had that conversation).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Any


class OutputMemory:
    def __init__(self, max_chars: int = 16 << 20):
        self.max_chars = max_chars
        self._entries: OrderedDict[tuple[str, str], array] = OrderedDict()  # (scope, text) -> ids
        self._chars = 0
        self.hits = 0
        self.reused_tokens = 0
        # prompts are rendered and tokenized on worker threads (transport.server.http
        # ServerState.chat_prompt) while answers are remembered on the loop
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def tokenize(self, text: str, encode: Any, scope: str = "") -> tuple[list[int], str | None]:
        """``text``'s ids, reusing the longest key kept in ``scope`` it starts with; and that key."""
        with self._lock:
            best = None
            for s, key in self._entries:
                if s == scope and (best is None or len(key) > len(best)) and text.startswith(key):
                    best = key
            if best is not None:
                self._entries.move_to_end((scope, best))
                ids = self._entries[scope, best].tolist()
                self.hits += 1
                self.reused_tokens += len(ids)
        if best is None:
            return encode(text), None
        rest = text[len(best) :]
        return ids + (encode(rest) if rest else []), best

    def remember(self, text: str, ids: list[int], replaces: str | None = None, scope: str = "") -> None:
        """Keep ``text``'s ``ids`` in ``scope`` (``replaces``: an older key of that scope to drop)."""
        with self._lock:
            self._remember(scope, text, ids, replaces)

    def _remember(self, scope: str, text: str, ids: list[int], replaces: str | None = None) -> None:
        if replaces is not None and (scope, replaces) in self._entries:
            self._chars -= len(replaces)
            del self._entries[scope, replaces]
        if (scope, text) in self._entries:
            self._entries.move_to_end((scope, text))
            return
        if len(text) > self.max_chars:
            return
        self._entries[scope, text] = array("i", ids)
        self._chars += len(text)
        while self._chars > self.max_chars:
            (_, old), _ = self._entries.popitem(last=False)
            self._chars -= len(old)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "chars": self._chars,
            "hits": self.hits,
            "reused_tokens": self.reused_tokens,
        }
