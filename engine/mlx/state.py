"""What the MLX backend's step phases share on the MLX thread: the row table,
the persistent ``DecodeBatch``, the queue of steps run ahead, the counters.

``MLXBackend`` (``engine.mlx.backend``) is one object because every phase
(close, open, prefill, decode, verify, run-ahead and its undo) mutates this
same state; each phase lives in its own module as a class over it
(``cache_ops``, ``row_phases``, ``prefill``, ``step_sampling``, ``run_ahead``)
and the backend composes them. This class only declares the fields, so each
phase says what it reads and the type checker holds them to it; the backend's
``__init__`` sets them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from engine.mlx import lora
from engine.mlx.batch import DecodeBatch
from engine.mlx.blas import BlasThreads
from engine.mlx.cpu_layout import CpuChoice
from engine.mlx.grammar import Grammars
from engine.mlx.rows import _Ahead, _Row
from engine.mlx.tokenizer import MLXTokenizer
from engine.ports import ModelInfo


class BackendState:
    model: Any
    tokenizer: MLXTokenizer
    info: ModelInfo
    grammars: Grammars
    blas: BlasThreads
    cpu_threads: CpuChoice  # OpenBLAS threads per decode width (cpu_layout.calibrate)
    cpu_choice: dict[str, Any]
    attention_parts: int  # attention split across this many CPU streams (engine.mlx.split_attention)
    softmax_kernel: Any  # the C softmax (engine.mlx.softmax_kernel), or None: MLX's own
    engine_seed: int
    # KV options
    max_kv_size: int | None
    kv_bits: int | None
    kv_group_size: int
    # what the cache kind allows (set at load from a probe cache)
    pipeline: bool  # running ahead
    prefill_together: bool
    needs_checkpoints: bool
    _plain_kv: bool
    _prefill_kind_off: bool
    _run_ahead_kind_off: bool
    # rows
    _rows: dict[int, _Row]
    _batch: DecodeBatch
    _refill: dict[int, list[int]]  # rid -> prefix to prefill: its prefix cache faulted (``_open``)
    # running ahead
    max_ahead: int
    _queued: list[_Ahead]  # steps computed ahead, oldest first
    _queued_inputs: dict[int, int]  # what the oldest one fed: the last tokens returned
    _due: mx.array | None  # inputs of the next step to run ahead
    _built: mx.array | None  # a step built ahead, not yet being computed
    _ahead_error: Exception | None
    # counted
    steps: int
    counters: dict[str, int]
    fallbacks: dict[str, int]
    # LoRA adapters served (engine.mlx.lora); none: every forward is the base model's
    adapters: lora.Adapters

    def _lora(self, rows: Iterable[_Row]) -> contextlib.AbstractContextManager[None]:
        """Around every forward over ``rows`` (in batch order): each row's
        adapter. A forward built outside it runs every row on the base model."""
        if not self.adapters.index:
            return contextlib.nullcontext()
        return lora.rows([r.adapter for r in rows])
