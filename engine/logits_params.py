"""Checks of SamplingParams' logits-processing fields (no MLX here: the
Gateway runs them on the event loop, for every backend).

Ranges are OpenAI's: penalties in [-2, 2], ``logit_bias`` values in
[-100, 100], at most 20 top logprobs. A backend that cannot apply them (the
fake GPU) refuses them by name instead of ignoring them.
"""

from __future__ import annotations

import math

from engine.errors import InvalidRequest
from engine.ports import ModelInfo
from engine.types import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


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
    used = active_fields(p)
    if used and not info.logits_processing:
        raise InvalidRequest(
            f"{used[0]} is not supported by this backend (the fake GPU has no logits processing; use backend='mlx')",
            used[0],
        )
