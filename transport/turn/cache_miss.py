"""A prompt-cache miss explained for the client: the message the divergence
falls in and both sides of it as text.

The Scheduler reports where a prompt left the closest cached sequence in
tokens (``engine.types.CacheMiss``, engine/kv/cache_miss.py). A chat route
knows the messages the prompt was rendered from: this module decodes the two
token windows and finds the message holding the divergence, then the routes
put the object in their usage (``prompt_tokens_details.cache_miss`` on Chat
Completions, ``cache_miss`` on Messages and Responses), ``/stats`` keeps the
last few, and the log says ``[cache] miss …`` (docs/agent-api.md, "Why a turn
missed the cache").

The message: the chat template renders ``messages[:k]`` (no generation
prompt) for the smallest ``k`` whose text runs past the divergence's
character offset — a bisect over ``k``, so a few renders, and only on a miss.
Text, not tokens, because a prompt's ids may be the model's own for an
earlier answer (transport/turn/output_memory.py), which a re-tokenization would
not reproduce.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any

from engine.types import CacheMiss

log = logging.getLogger("ember.cache")

KEEP = 8  # the misses /stats lists


class MissLog:
    """The misses one engine explained: a count and the last ``KEEP``."""

    def __init__(self) -> None:
        self.count = 0
        self.last: deque[dict[str, Any]] = deque(maxlen=KEEP)

    def add(self, body: dict[str, Any]) -> None:
        self.count += 1
        self.last.append(body)

    def stats(self) -> dict[str, Any]:
        return {"count": self.count, "last": list(self.last)}


_LOGS: weakref.WeakKeyDictionary[Any, MissLog] = weakref.WeakKeyDictionary()


def miss_log(engine: Any) -> MissLog:
    got = _LOGS.get(engine)
    if got is None:
        got = _LOGS[engine] = MissLog()
    return got


def body(miss: CacheMiss) -> dict[str, Any]:
    """The object the APIs report."""
    return {
        "diverged_at": miss.diverged_at,
        "cached_tokens_available": miss.cached_tokens_available,
        "message_index": miss.message_index,
        "message_role": miss.message_role,
        "prompt_excerpt": miss.prompt_excerpt,
        "cached_excerpt": miss.cached_excerpt,
        "tier": miss.tier,
    }


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def message_index(tok: Any, prompt: Any, diverged_at: int) -> int | None:
    """The index of the message whose rendering holds prompt token
    ``diverged_at`` (None: past the last message, in the generation prompt, or
    the prompt has no messages to say it with)."""
    messages, text = getattr(prompt, "messages", None), getattr(prompt, "text", None)
    if not messages or text is None:
        return None
    at = len(tok.decode(list(prompt[:diverged_at])))  # the divergence as a character offset
    tools, kw = prompt.tools, prompt.template_kwargs or {}

    def reaches(k: int) -> bool:  # messages[:k] rendered runs past ``at``
        try:
            part = tok.render_chat(messages[:k], tools, generation_prompt=False, **kw)
        except Exception:  # a template that cannot render a partial chat: not there yet
            return False
        return _common_chars(part, text) > at

    lo, hi = 1, len(messages)
    if not reaches(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def explain(engine: Any, prompt: Any, miss: CacheMiss) -> dict[str, Any]:
    """Fill in ``miss``'s message and excerpts, keep it for /stats, log it and
    return its body. Runs off the event loop (a few template renders)."""
    if miss.prompt_excerpt is None:  # n choices share one usage: explained once
        tok = engine.tokenizer
        miss.prompt_excerpt = tok.decode(miss.prompt_window)
        miss.cached_excerpt = tok.decode(miss.cached_window)
        if hasattr(tok, "render_chat"):
            try:
                miss.message_index = k = message_index(tok, prompt, miss.diverged_at)
                if k is not None:
                    miss.message_role = prompt.messages[k].get("role")
            except Exception as exc:  # the report is a courtesy: never fail the answer for it
                log.warning("[cache] miss message lookup failed: %r", exc)
        out = body(miss)
        miss_log(engine).add(out)
        log.info(
            "[cache] miss diverged_at=%d message=%s role=%s tier=%s cached_available=%d prompt=%r cached=%r",
            miss.diverged_at,
            miss.message_index,
            miss.message_role,
            miss.tier,
            miss.cached_tokens_available,
            miss.prompt_excerpt,
            miss.cached_excerpt,
        )
    return body(miss)
