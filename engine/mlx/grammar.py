"""Grammars for constrained decoding: llguidance matchers, compiled once per
``(kind, source)`` and copied per request.

Why llguidance (docs/structured-output.md has the comparison): it computes a
row's allowed-token bitmask in tens of microseconds on the CPU, with no
per-grammar precompilation over the whole vocabulary, takes JSON Schema, Lark
and regular expressions through one API, and its matcher can ``rollback(n)``
tokens, which speculative decoding needs when a verify window's drafts are
rejected. vLLM, SGLang and llama.cpp use it.

Compiling is building an ``LLMatcher`` (it drops the GIL while it builds the
grammar; up to ~1 s for a huge schema). ``Engine.asubmit`` compiles on a
worker thread before admission, so the event loop never waits for it and a
bad grammar is refused (``InvalidRequest``) before the request exists; the
MLX thread then only ``deep_copy``s the cached matcher (microseconds).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance
import msgspec

from engine.closed_schema import close_objects
from engine.errors import InvalidRequest
from engine.types import Constraint

# JSON from a schema is written compactly: with llguidance's default
# ("flexible" whitespace, any run of blanks between tokens) a small model can
# emit blanks until max_tokens and never close the object.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 128  # compiled grammars kept (an agent session reuses a handful of schemas)


def _grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked)."""
    LL = llguidance.LLMatcher
    if c.kind == "json_object":
        return LL.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = msgspec.json.decode(c.source)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", "constraint") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("a JSON schema must be an object (or true/false)", "constraint")
        try:
            return LL.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"invalid JSON schema: {exc}", "constraint") from None
    if c.kind == "lark":
        return LL.grammar_from_lark(c.source)
    if c.kind == "regex":
        return LL.grammar_from_regex(c.source)
    raise InvalidRequest(f"unknown constraint kind {c.kind!r}", "constraint")


class Grammars:
    """Compiled matchers by ``(kind, source)`` for one tokenizer; thread-safe
    (compiled on worker threads, copied on the MLX thread)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: list[int]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None  # built on first use (~20 ms for a small vocab, ~1 s for a large one)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.counters = {"compiled": 0, "hits": 0, "refused": 0}

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer

                try:
                    self._tokenizer = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)
                except ValueError as exc:  # only fast (Rust tokenizers) tokenizers are supported
                    raise InvalidRequest(
                        f"constrained decoding is not available for this model's tokenizer: {exc}", "constraint"
                    ) from None
            return self._tokenizer

    def compile(self, c: Constraint) -> Any:
        """The cached matcher for ``c`` (compiled now if new); ``InvalidRequest`` if
        the grammar is invalid or uses what llguidance does not support."""
        key = (c.kind, c.source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.counters["hits"] += 1
                return hit
        text = _grammar_text(c)
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            with self._lock:
                self.counters["refused"] += 1
            raise InvalidRequest(f"unsupported or invalid {c.kind} constraint: {matcher.get_error()}", "constraint")
        with self._lock:
            self._cache[key] = matcher
            self.counters["compiled"] += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, c: Constraint) -> Any:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return self.compile(c).deep_copy()
