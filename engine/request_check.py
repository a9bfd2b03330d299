"""The one check of a request's parameters against ``engine.limits`` (no MLX
here: the Gateway runs it on the event loop, for every backend and every entry
point — the embedded API and each HTTP API alike).

The transports decode their own shapes and map them to ``SamplingParams``;
the ranges are checked here, once, and an ``InvalidRequest`` names the
``SamplingParams`` field (a transport reports it under its own spelling,
e.g. ``max_output_tokens``). A backend that cannot apply the logits
processing (the fake GPU) refuses it by name instead of ignoring it. Whether
this engine can speculate at all (it has a drafter) is not a limit but its
build: ``ember.spec_build`` refuses that before admission.
"""

from __future__ import annotations

import math

from engine.errors import InvalidRequest
from engine.limits import (
    MAX_DRAFT_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)
from engine.ports import ModelInfo
from engine.types import SamplingParams


def active_fields(p: SamplingParams) -> list[str]:
    """The logits-processing fields this request sets (beyond their neutral value)."""
    out = []
    if p.constraint is not None:
        out.append("constraint")
    if p.logprobs is not None:
        out.append("logprobs")
    if p.logit_bias:
        out.append("logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            out.append(name)
    if p.repetition_penalty != 1.0:
        out.append("repetition_penalty")
    return out


def check_limits(tokens: list[int], p: SamplingParams, info: ModelInfo) -> None:
    """Refuse a request the engine cannot run as asked (``InvalidRequest``)."""
    if not tokens:
        raise InvalidRequest("the prompt is empty", "prompt")
    if p.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
    if len(tokens) + p.max_tokens > info.context_length:
        raise InvalidRequest(
            f"prompt ({len(tokens)} tokens) plus max_tokens ({p.max_tokens}) exceeds "
            f"the model's context of {info.context_length} tokens",
            "max_tokens" if len(tokens) < info.context_length else "prompt",
        )
    # in C (map, min, max) rather than a generator: prompts are thousands of tokens
    if not set(map(type, tokens)) <= {int} or min(tokens) < 0 or max(tokens) >= info.vocab_size:
        raise InvalidRequest("a prompt token id is outside the vocabulary", "prompt")
    check_sampling(p)
    check_logits_params(p, info)


def check_sampling(p: SamplingParams) -> None:
    if p.temperature < 0 or not math.isfinite(p.temperature):
        raise InvalidRequest("temperature must be a finite number >= 0", "temperature")
    if not (0.0 < p.top_p <= 1.0):
        raise InvalidRequest("top_p must be in (0, 1]", "top_p")
    if p.top_k < 0:
        raise InvalidRequest("top_k must be >= 0", "top_k")
    if not (0.0 <= p.min_p <= 1.0):
        raise InvalidRequest("min_p must be in [0, 1]", "min_p")
    if p.seed is not None and not (0 <= p.seed < 2**64):
        # numpy and MLX both refuse other seeds, and inside a GPU step that
        # error would take the whole engine down.
        raise InvalidRequest("seed must be in [0, 2**64)", "seed")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters", "stop")
    n = p.num_draft_tokens
    if n is not None and not 0 <= n <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]", "num_draft_tokens")


def check_logits_params(p: SamplingParams, info: ModelInfo) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise InvalidRequest(f"{name} must be in [-2, 2]", name)
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise InvalidRequest("repetition_penalty must be a finite number > 0", "repetition_penalty")
    for tok, bias in p.logit_bias.items():
        if not (isinstance(tok, int) and 0 <= tok < info.vocab_size):
            raise InvalidRequest(f"logit_bias key {tok!r} is not a token id of this model's vocabulary", "logit_bias")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidRequest(f"logit_bias values must be in [-100, 100] (token {tok}: {bias})", "logit_bias")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs (top alternatives) must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    if p.constraint is not None and p.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a constraint: the grammar ends with EOS", "ignore_eos")
    used = [f for f in active_fields(p) if not (f == "constraint" and info.constraints)]
    if used and not info.logits_processing:
        raise InvalidRequest(
            f"{used[0]} is not supported by this backend (the fake GPU has no logits processing; use backend='mlx')",
            used[0],
        )
