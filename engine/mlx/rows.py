"""A row of the MLX backend as it lives on the MLX thread (``_Row``: its
sampler, its own B=1 cache until it joins the ``DecodeBatch``, what it has
been fed) and a decode step computed ahead of the Scheduler (``_Ahead``, see
``engine.mlx.backend``'s docstring). Moved out of ``backend.py`` as they were."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.mlx.logits import RowLogits
from engine.mlx.sampling import RowSampler


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "unable to allocate" in text or "out of memory" in text or "bad_alloc" in text


@dataclass(slots=True)
class _Row:
    rid: int
    sampler: RowSampler
    max_tokens: int
    cache: list[Any] | None  # its own B=1 cache; None once it is in the DecodeBatch
    fed: int = 0  # tokens committed to its KV cache
    emitted: int = 0  # decode tokens handed back
    logits: RowLogits | None = None  # processors, grammar mask, logprobs (engine.mlx.logits)
    adapter: int = 0  # its LoRA adapter's index (engine.mlx.lora); 0: the base model


def _own_cache(row: _Row) -> list[Any]:
    """The B=1 cache of a row not (yet) in the DecodeBatch."""
    assert row.cache is not None, "a row outside the DecodeBatch holds its own cache"
    return row.cache


def _row_logits(row: _Row) -> RowLogits:
    """The logits processing of a row known to have it."""
    assert row.logits is not None, "a row with logits processing"
    return row.logits


@dataclass(slots=True)
class _Ahead:
    """A decode step of the whole batch computed ahead (see the module docstring)."""

    tokens: mx.array  # [B] its sampled tokens, in batch order
    keys: list[tuple[_Row, mx.array]]  # the sampled rows' PRNG keys before it, to undo it
    fed: Sequence[_Row] = ()  # rows whose RowLogits were fed its inputs (undo: trim 1)
    logprobs: dict[int, tuple[mx.array, ...]] | None = None  # lazy, by rid
