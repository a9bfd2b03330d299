"""Loading a model for the MLX backend: ``mlx_lm.load``, then on MLX's CPU
backend the weight layout and OpenBLAS thread counts measured on this model
(``engine.mlx.cpu_layout``, cached on disk), with quantized layers routed
through ``engine.mlx.qmm_kernel`` first (so the calibration times the model as
it will run); and the ``ModelInfo`` the engine
keys its caches by (the fingerprint covers the KV scheme: cache kinds, dtype,
weights, window and quantization)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.config import EngineConfig
from engine.mlx import dot_crossover, fmm_linear, qmm_linear
from engine.mlx.blas import blas_threads
from engine.mlx.calibration_cache import cached_calibration, calibration_key
from engine.mlx.cpu_layout import CpuChoice, PretransposedLinear, apply_choice, calibrate, wants_pretranspose
from engine.mlx.model_identity import config_fingerprint, context_length, weights_digest
from engine.ports import ModelInfo

log = logging.getLogger("ember.mlx")


class LoadedModel(NamedTuple):
    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict[str, Any]
    weights_digest: str
    cpu_choice: CpuChoice | None  # None off MLX's CPU backend
    qmm_layers: int = 0  # quantized layers taking engine.mlx.qmm_kernel (MLX's CPU backend)
    fmm_layers: int = 0  # float32 layers taking engine.mlx.fmm_linear's kernel (MLX's CPU backend)


def read_model(path: pathlib.Path, config: EngineConfig) -> LoadedModel:
    """The model at ``path`` as mlx-lm loads it, laid out for the CPU where it runs there."""
    from mlx_lm import load

    model, tokenizer, model_config = load(str(path), return_config=True)
    choice = None
    qmm_layers = fmm_layers = 0
    digest = weights_digest(path)
    if wants_pretranspose():  # MLX's CPU backend: layout and thread counts measured on this model, cached
        if config.qmm_kernel:
            qmm_layers = qmm_linear.install(model, prefill=config.qmm_prefill, dot=config.qmm_dot)
            if qmm_layers:  # where this CPU's GEMM beats the dot path for prefill (measured once, kept)
                dot_crossover.apply(model)
        if config.fmm_kernel:  # before the layout: a hooked layer is not pretransposed
            fmm_layers = fmm_linear.install(model)
        blas, allow = blas_threads(), config.cpu_pretranspose
        flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
        params = (v for _, v in flat if mx.issubdtype(v.dtype, mx.floating))
        key = calibration_key(
            # the kernel changes what the calibration times: its choice is another entry
            model=f"{path.resolve()}:{digest}"
            + (":qmm-kernel" if qmm_layers else "")
            + (":qmm-prefill" if qmm_layers and qmm_linear.prefill_rows() else "")
            + (":qmm-dot" if qmm_layers and qmm_linear.dot() else "")
            + (":qmm-graph" if qmm_layers and qmm_linear.in_graph() else "")
            + (":fmm-kernel" if fmm_layers else ""),
            dtype=str(next(params, mx.array(0.0)).dtype),
            blas=blas,
            allow_pretranspose=allow,
        )
        choice = cached_calibration(
            key,
            lambda: calibrate(model, blas, allow_pretranspose=allow),
            lambda c: apply_choice(model, c, allow_pretranspose=allow),
        )
        log.info("[mlx] CPU choices for %s: %s", path.name, choice.as_dict())
    return LoadedModel(model, tokenizer, model_config, digest, choice, qmm_layers, fmm_layers)


def pretransposed_linears(model: Any) -> int:
    return sum(type(m) is PretransposedLinear for _, m in model.named_modules())


def model_info(
    model: Any,
    tokenizer: Any,
    config: dict[str, Any],
    probe: list[Any],
    *,
    vocab_fallback: Callable[[], int],
    model_id: str,
    tokenizer_hash: str,
    weights_digest: str,
    max_kv_size: int | None,
    kv_bits: int | None,
    kv_group_size: int,
) -> ModelInfo:
    """``vocab_fallback``: asked only when the config names no vocabulary size;
    ``probe``: a fresh cache of the model, whose layer kinds are part of the KV scheme."""
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))  # a list without destination=
    floats = (v for _, v in params if mx.issubdtype(v.dtype, mx.floating))
    first = next(floats, None)
    kv_scheme = [type(c).__name__ for c in probe] + [str(first.dtype if first is not None else "")]
    if weights_digest:
        kv_scheme.append(f"weights:{weights_digest}")
    if max_kv_size:
        kv_scheme.append(f"max_kv_size:{max_kv_size}")
    if kv_bits:
        kv_scheme.append(f"kv_bits:{kv_bits}:{kv_group_size}")
    text_cfg = config.get("text_config") or {}
    vocab = config.get("vocab_size") or text_cfg.get("vocab_size") or vocab_fallback()
    return ModelInfo(
        model_id=model_id,
        vocab_size=int(vocab),
        context_length=context_length(config, tokenizer),
        config_fingerprint=config_fingerprint(config, kv_scheme),
        tokenizer_hash=tokenizer_hash,
        num_layers=len(getattr(model, "layers", probe)),
        logits_processing=True,
        constraints=True,
    )
