"""Plain data shared by the engine, the actors and the transports."""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.limits import DEFAULT_MAX_TOKENS


class Constraint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A grammar the output must match, enforced by masking logits per row.

    ``kind`` says how ``source`` reads: a JSON Schema (``json_schema``), any JSON
    object (``json_object``, ``source`` empty), a Lark grammar in llguidance's
    dialect (``lark``), or a regular expression (``regex``)."""

    kind: Literal["json_schema", "json_object", "lark", "regex"]
    source: str = ""


class TokenLogprob(msgspec.Struct, kw_only=True):
    """One sampled token's log-probability and, when asked for, its top rivals."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


# A temperature below this is greedy: 1/T overflows float32 near 1e-38 (and
# the logits' scale makes sampling at T < 1e-5 indistinguishable from argmax
# anyway), which turned temperature 1e-39 into random text (issue #23).
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request generation settings (greedy when ``temperature < GREEDY_TEMPERATURE``)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    # Logits processing (OpenAI semantics; 0 / empty = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # None: no logprobs; k >= 0: the sampled token's logprob and its top k rivals.
    logprobs: int | None = None
    constraint: Constraint | None = None
    # Speculation overrides (None = the engine default).
    num_draft_tokens: int | None = None
    speculate: bool | None = None
    # The client's session key for the prompt cache (``prompt_cache_key``,
    # Anthropic's ``metadata.user_id``): the RAM tier evicts a live session's
    # recent entries last (engine.kv.prompt_cache). Never changes the output.
    cache_session: str | None = None


class SpecUsage(msgspec.Struct, kw_only=True):
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    acceptance_rate: float = 0.0
    mean_accept_len: float = 0.0


class CacheMiss(msgspec.Struct, kw_only=True):
    """Why a prompt missed the prompt cache: where it left the closest cached
    sequence of its namespace (one with tokens past the common prefix, so a
    real divergence, not a plain extension). The Scheduler fills the token
    fields (engine.kv.cache_miss); the chat routes add the message the
    divergence falls in and the decoded excerpts (transport/turn/cache_miss.py)."""

    diverged_at: int  # the first prompt token that differs from the cached sequence
    cached_tokens_available: int  # the cached sequence's length
    tier: str  # where that sequence is held: "ram" or "ssd"
    window_start: int  # the first token of both windows
    prompt_window: list[int]  # the prompt's tokens around ``diverged_at``
    cached_window: list[int]  # the cached sequence's tokens there
    message_index: int | None = None  # in the messages the chat template rendered
    message_role: str | None = None
    prompt_excerpt: str | None = None
    cached_excerpt: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ssd_cached_tokens: int = 0  # the part of cached_tokens restored from the SSD tier (the rest came from RAM)
    speculation: SpecUsage | None = None
    cache_miss: CacheMiss | None = None  # set when the prompt diverged from a cached sequence

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Delta(msgspec.Struct, kw_only=True):
    """One piece of a request's output stream. The last one has a ``finish_reason``
    (``stop``, ``length`` or ``abort``) and the ``usage``."""

    rid: int
    text: str = ""
    token_ids: list[int] = []
    # One per token in ``token_ids`` when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
