"""The MLX backend: ``engine.ports.Backend`` on an mlx-lm model.

Every method runs on one dedicated thread (``engine.mlx.device.MLXThread``, a
``ThreadDevice``), which owns MLX: loading, forwards, cache surgery. Any mlx-lm model directory
works; a "cache" is an mlx-lm prompt cache (``make_prompt_cache(model)``).

Why not ``mlx_lm.BatchGenerator``. It is a scheduler of its own: it decides
when prompts are admitted and how they are chunked, applies stop tokens and
max_tokens, and has no per-row trim or verify. Our Scheduler already makes
those decisions and hands the device one explicit ``StepPlan`` per step, so
the backend reuses the layer below BatchGenerator, mlx-lm's batch caches
(``merge``/``extend``/``extract``/``filter``/``prepare``/``finalize``, see
``engine.mlx.batch``), and its sampling filters (``engine.mlx.sampling``).

Design:

* Prefill: each row prefills into its own B=1 cache, chunk by chunk, like
  ``mlx_lm.generate_step`` (model call, ``mx.eval`` of the cache state), so
  prompt numerics match mlx-lm bit for bit, except that chunks of rows at the
  same cache offset in one step share one right-padded forward
  (``_prefill_together``: 1.5x faster for 8 short prompts, ~1e-6 apart in fp32;
  ``EngineConfig(batch_prefill=False)`` turns it off).
* Decode: rows past prefill live in one persistent ``DecodeBatch``; a step is
  ONE forward over all of them. A row joins at its first decode/verify (its
  first step runs on a batch of the joiners, then they are ``extend``ed in) and
  leaves on close (``extract`` for the prompt cache, then ``filter``).
* Running ahead: after a pure decode step the backend marks the next decode
  step due, and the MLX thread runs it (``run_ahead``) right after handing
  the result to the event loop, so MLX computes token n+1 while the loop
  runs the Scheduler and streams token n (on MLX's CPU backend
  ``async_eval`` computes most of a graph before it returns, so queueing it
  inside ``step`` like ``generate_step`` does would delay the result). The
  next plan normally decodes the same rows with exactly those tokens and
  takes the result. If it does anything else to the batch (a trim, a verify,
  a different token, a row left out) the steps run ahead are undone:
  ``trim`` of the batch cache and the rows' PRNG keys put back. Rows that
  close just drop the tokens fed ahead (``extract`` then ``trim``). Only for
  caches that can give a step back: plain or quantized KV, and sliding
  windows until their ring wraps (``_ahead_fits``); not SSM state.
* Cache kinds (docs/compat-matrix.md): rotating windows, SSM state and
  ``CacheList`` prefill together through mlx-lm's batch caches
  (``_prefill_merged``), quantized KV through ``engine.mlx.quantized_batch``;
  a path a kind rules out is taken the plain way and counted in
  ``fallbacks`` (/stats); rows of caches that may not trim back to their
  prompt hand the Scheduler checkpoints (``StepPlan.checkpoint``).
* Verify (``VerifyRow``): the window goes through the same batched forward;
  rows with shorter windows (decode rows: 1 token) are right-padded and the
  padding is rolled away, and every position's token is returned. Trims after
  a verify are per row (``DecodeBatch.trim``). This is the seam for
  speculative decoding; nothing runs ahead after a verify step. When windows
  follow a step run ahead whose inputs were their first tokens, that step is
  kept as the windows' first position and only the drafts are fed
  (``_queue_heads_windows``), instead of undoing a whole decode.
"""

# Over 500 lines on purpose (issue 18): ``MLXBackend`` is one object because its
# step phases (close, open, prefill, decode, verify, run-ahead and its undo) all
# mutate the same row table and persistent DecodeBatch on the MLX thread; the
# parts without that state live apart (cache_views, model_identity, batch,
# sampling, logits, cpu_layout).
from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from engine.config import EngineConfig
from engine.device import ThreadDevice
from engine.errors import InvalidRequest
from engine.mlx.batch import DecodeBatch, merge_caches
from engine.mlx.blas import blas_threads
from engine.mlx.cache_views import CachePrefix, layer_nbytes, prefix_view, snapshot_cache
from engine.mlx.calibration_cache import cached_calibration, calibration_key
from engine.mlx.cpu_layout import (
    SMALL_FORWARD_ROWS,
    CpuChoice,
    PretransposedLinear,
    apply_choice,
    calibrate,
    wants_pretranspose,
)
from engine.mlx.device import MLXThread
from engine.mlx.grammar import Grammars
from engine.mlx.logits import RowLogits, apply_words, needs_processing, to_token_logprobs
from engine.mlx.model_identity import (
    config_fingerprint,
    context_length,
    tokenizer_hash,
    weights_digest,
)
from engine.mlx.rows import _Ahead, _is_oom, _own_cache, _Row, _row_logits
from engine.mlx.sampling import RowSampler, row_seed
from engine.mlx.tokenizer import MLXTokenizer
from engine.ports import ModelInfo, StepPlan, StepResult

log = logging.getLogger("ember.mlx")

CLEAR_CACHE_EVERY = 256  # steps; as generate_step, to hand freed buffers back
# OpenBLAS threads per decode width (engine.mlx.blas): before measurement, at most
# SMALL_FORWARD_ROWS rows on one thread (the toy's rule: a 1-row decode and a
# batch-1 verify window up to γ = 4, docs/bench/spec.md); on the CPU the count per
# row bucket is measured per model at load (cpu_layout.calibrate, cached on disk).


def load_mlx_backend(config: EngineConfig) -> tuple[MLXBackend, ThreadDevice]:
    """Resolve ``config.model``, start the MLX thread and load the model on it."""
    from engine.models import resolve_model

    path = resolve_model(config.model)
    device = MLXThread()
    try:
        backend = device.call(MLXBackend.load, path, config)
    except BaseException:
        device.close()
        raise
    device.after_each = lambda: backend.run_ahead(device.idle)
    return backend, device


class MLXBackend:
    """Implements ``engine.ports.Backend``; every call runs on the MLX thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: dict[str, Any],
        *,
        model_id: str,
        tokenizer_hash: str,
        engine_seed: int = 0,
        pipeline: bool = True,
        weights_digest: str = "",
        prefill_together: bool = True,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ):
        self.model = model
        self.tokenizer = MLXTokenizer(tokenizer)
        self.blas = blas_threads()
        # OpenBLAS threads per decode width; measured per model at load (cpu_layout.calibrate)
        self.cpu_threads = CpuChoice(False, {SMALL_FORWARD_ROWS: 1}, {})
        self.cpu_choice: dict[str, Any] = {}
        self.engine_seed = engine_seed
        self.max_kv_size = max_kv_size
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        probe = self.make_cache()
        if kv_bits:
            self._check_kv_groups(kv_bits, kv_group_size)
        # Running ahead needs a batch that can give a step back (``_undo``): plain or
        # quantized KV always, a sliding window while it has not wrapped (``_ahead_fits``)
        self.pipeline = pipeline and all(type(c) in (KVCache, RotatingKVCache) for c in probe)
        # Rows prefilling together: plain KV caches through slices (``_prefill_together``),
        # other kinds through batch caches (``_prefill_merged``) when every layer has
        # one (a ChunkedKVCache has none: those rows prefill alone, counted).
        self._plain_kv = all(type(c) is KVCache for c in probe) and not kv_bits
        self.prefill_together = prefill_together and (self._plain_kv or all(hasattr(c, "merge") for c in probe))
        self._prefill_kind_off = prefill_together and not self.prefill_together
        # caches that may become impossible to trim back to a prompt's end (SSM
        # state, a rotating window once it wraps, lists of those): the Scheduler
        # asks for checkpoints of them (StepPlan.checkpoint)
        self.needs_checkpoints = not all(type(c) in (KVCache, QuantizedKVCache) for c in probe)
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
        vocab = config.get("vocab_size") or text_cfg.get("vocab_size") or len(self.tokenizer)
        self.info = ModelInfo(
            model_id=model_id,
            vocab_size=int(vocab),
            context_length=context_length(config, tokenizer),
            config_fingerprint=config_fingerprint(config, kv_scheme),
            tokenizer_hash=tokenizer_hash,
            num_layers=len(getattr(model, "layers", probe)),
            logits_processing=True,
            constraints=True,
        )
        self._rows: dict[int, _Row] = {}
        self._batch = DecodeBatch()
        self.grammars = Grammars(
            getattr(tokenizer, "_tokenizer", tokenizer), self.info.vocab_size, sorted(self.tokenizer.eos_token_ids)
        )
        # Decode steps computed ahead of the Scheduler at most. One: deeper runs
        # measured slower, as their graph building holds the GIL the event loop
        # needs and a plan that arrives waits for the forward in progress.
        self.max_ahead = 1
        self._queued: list[_Ahead] = []  # steps computed ahead, oldest first
        self._queued_inputs: dict[int, int] = {}  # what the oldest one fed: the last tokens returned
        self._due: mx.array | None = None  # inputs of the next step to run ahead
        self._built: mx.array | None = None  # a step built ahead, not yet being computed
        self._ahead_error: Exception | None = None
        self.steps = 0
        self.counters = {
            "pipelined": 0,
            "undone": 0,
            "ahead_heads_windows": 0,
            "prefill_together": 0,
            "cache_faults": 0,
        }
        self._refill: dict[int, list[int]] = {}  # rid -> prefix to prefill: its prefix cache faulted (``_open``)
        # Paths a cache kind ruled out, each time it did (/stats "fallbacks"):
        # spec_untrimmable: a verify window cut to a plain decode (the cache cannot roll back);
        # run_ahead_off: decode steps not run ahead (only all-KVCache batches can undo one);
        # prefill_alone: prefill chunks that could have shared a forward but not this kind;
        # keep_cache_failed: a finished row's cache could not be kept (a miss later, not an error).
        # checkpoint_failed: a checkpoint could not be copied (a later miss, not an error).
        self.fallbacks = {
            "spec_untrimmable": 0,
            "run_ahead_off": 0,
            "prefill_alone": 0,
            "keep_cache_failed": 0,
            "checkpoint_failed": 0,
        }
        self._run_ahead_kind_off = pipeline and not self.pipeline

    @classmethod
    def load(cls, path: pathlib.Path, config: EngineConfig) -> MLXBackend:
        from mlx_lm import load

        model, tokenizer, model_config = load(str(path), return_config=True)
        choice = None
        digest = weights_digest(path)
        if wants_pretranspose():  # MLX's CPU backend: layout and thread counts measured on this model, cached
            blas, allow = blas_threads(), config.cpu_pretranspose
            flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
            params = (v for _, v in flat if mx.issubdtype(v.dtype, mx.floating))
            key = calibration_key(
                model=f"{path.resolve()}:{digest}",
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
        backend = cls(
            model,
            tokenizer,
            model_config,
            model_id=config.model_name or str(config.model),
            tokenizer_hash=tokenizer_hash(path),
            engine_seed=config.seed,
            weights_digest=digest,
            prefill_together=config.batch_prefill,
            max_kv_size=config.max_kv_size,
            kv_bits=config.kv_bits,
            kv_group_size=config.kv_group_size,
        )
        backend.counters["pretransposed_linears"] = sum(
            type(m) is PretransposedLinear for _, m in model.named_modules()
        )
        if choice is not None:
            backend.cpu_threads = choice
            backend.cpu_choice = choice.as_dict()
        return backend

    # ---- caches --------------------------------------------------------------
    def make_cache(self) -> list[Any]:
        """A fresh cache for one row: mlx-lm's (the model's own ``make_cache``, or
        plain KV), with every plain KV layer a sliding window of ``max_kv_size``
        tokens when that is set. That is mlx-lm's ``--max-kv-size`` with two
        differences: no ``keep`` (mlx-lm's batch rotating cache has no attention
        sinks, and a row must compute the same batched or alone), and it also
        applies to models that make their own cache (mlx-lm 0.32 ignores it for
        those, llama included)."""
        cache = make_prompt_cache(self.model)
        if self.max_kv_size:
            cache = [RotatingKVCache(max_size=self.max_kv_size, keep=0) if type(c) is KVCache else c for c in cache]
        return cache

    def _check_kv_groups(self, bits: int, group_size: int) -> None:
        """Refuse ``--kv-bits`` at load when a KV layer's head dimension is not a
        multiple of the group size: ``mx.quantize`` would raise on the first
        request (engine_dead) instead. The dimensions come from a one-token
        forward, so every architecture's layout (MLA, differing K and V) is seen."""
        cache = self.make_cache()
        self.model(mx.array([[0]]), cache=cache)
        dims = sorted(
            {int(x.shape[-1]) for c in cache if type(c) is KVCache and c.keys is not None for x in (c.keys, c.values)}
        )
        bad = [d for d in dims if d % group_size]
        if bad:
            fits = [g for g in (128, 64, 32) if all(d % g == 0 for d in dims)]
            hint = (
                f"; --kv-group-size {fits[0]} divides it" if fits else "; no --kv-group-size (32, 64, 128) divides it"
            )
            raise InvalidRequest(
                f"--kv-bits {bits} cannot quantize this model's KV cache: its head dimension {bad[0]} is not a "
                f"multiple of --kv-group-size {group_size}{hint}",
                "kv_group_size",
            )

    def _quantize(self, cache: list[Any]) -> None:
        """``--kv-bits``: plain KV layers become ``QuantizedKVCache`` once they hold
        tokens, as ``mlx_lm.generate_step`` does after each forward with
        ``quantized_kv_start=0`` (the first chunk attends to itself unquantized)."""
        if not self.kv_bits:
            return
        for i, c in enumerate(cache):
            if type(c) is KVCache and c.keys is not None:
                cache[i] = c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)

    def cache_nbytes(self, cache: list[Any]) -> int:
        """Bytes of the tokens in use; mlx-lm's ``nbytes`` counts the 256-step capacity."""
        return sum(layer_nbytes(c) for c in cache)

    def prefix_view(self, cache: list[Any], n: int) -> CachePrefix:
        """Called on the event loop: checks the length, defers the slicing to ``_open``."""
        held = [c.offset for c in cache if type(c) is KVCache and c.keys is not None]
        if any(h < n for h in held):
            raise ValueError(f"the cache holds {min(held)} tokens, not {n}")
        return CachePrefix(cache, n)

    def trim_cache(self, cache: list[Any], n: int) -> int:
        return trim_prompt_cache(cache, n)

    def cache_trimmable(self, cache: list[Any]) -> bool:
        return can_trim_prompt_cache(cache)

    def step_cost_s(self, plan: StepPlan) -> float:
        return 0.0

    # ---- the step ------------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        with mx.stream(generation_stream):
            try:
                return self._step(plan)
            except MemoryError:
                self._forget(plan)
                raise
            except RuntimeError as exc:
                if _is_oom(exc):
                    self._forget(plan)
                    raise MemoryError(str(exc)) from exc
                raise

    def _forget(self, plan: StepPlan) -> None:
        """After a failed step, drop the state it may have left half-updated: the
        rows it touched and the whole batch (a later step for a dropped row
        reports a per-row error)."""
        self._queued, self._due, self._built = [], None, None
        touched = {o.rid for o in plan.open} | {c.rid for c in plan.prefill}
        touched |= {d.rid for d in plan.decode} | {v.rid for v in plan.verify} | {r for r, _ in plan.trim}
        touched |= set(self._batch.rids)
        for rid in touched:
            self._rows.pop(rid, None)
        self._batch = DecodeBatch()
        mx.clear_cache()

    def _step(self, plan: StepPlan) -> StepResult:
        """One plan, in the numbered order of its effects (as ``Scheduler._step``):
        close, open, trim and prefill before any decode, so a row opened and
        prefilled in this step decodes in it too."""
        res = StepResult()
        self.steps += 1
        width = len(plan.decode) + sum(len(v.tokens) for v in plan.verify)
        self.blas.use(0 if plan.prefill else self.cpu_threads.threads_for(width))
        self._due = self._built = None  # without the run-ahead hook a built step is computed when read
        if self._ahead_error is not None:
            exc, self._ahead_error = self._ahead_error, None
            raise exc
        # 1. the step run ahead: kept when this plan is what it computed, else undone
        queued, self._queued = self._queued, []
        heads = False  # the step run ahead is the first position of this step's verify windows
        if queued and not self._queue_fits(plan):
            heads = self._queue_heads_windows(plan, queued)
            if not heads:
                self._undo(queued)
                queued = []
        # 2. close rows leaving (their caches kept), then 3. open, trim and 4. prefill
        queued_tokens = self._close(plan, res, queued)
        self._open(plan, res)
        self._trim(plan, res)
        self._prefill(plan, res)
        # 5. checkpoints of the rows asked for, as they stand after prefill
        self._checkpoint(plan, res)
        # 6. this step's work: a decode token or a verify window per row
        work = self._work(plan, res)
        verify_rids = {v.rid for v in plan.verify}
        batch = self._batch
        joiners = [rid for rid in work if self._rows[rid].cache is not None]
        verifying = bool(plan.verify)

        # 7. the decode batch's forward (or the step run ahead's tokens), then rows joining it
        outputs: list[tuple[list[int], list[int] | None, Any, dict]] = []  # (rids, widths, tokens, logprobs)
        step_tokens: list[mx.array] = []  # [B] per group, for the next queued step
        if queued:
            for rid in batch.rids:
                self._rows[rid].fed += 1
            outputs.append((list(batch.rids), None, queued_tokens[0], queued.pop(0).logprobs or {}))
            step_tokens.append(queued_tokens[0])
            queued_tokens = queued_tokens[1:]
            self.counters["pipelined"] += 1
            if joiners and queued:
                self._undo(queued)  # computed without the rows joining now
                queued, queued_tokens = [], []
        elif any(rid in batch for rid in work):
            inputs = [work.get(rid, []) for rid in batch.rids]
            logits = batch.forward(self.model, inputs)
            outputs.append(self._sample(batch.rids, inputs, logits, step_tokens))
            for rid, toks in zip(batch.rids, inputs):
                self._rows[rid].fed += len(toks)  # else a later trim is clipped to a stale `fed`
        rest = None
        if heads:  # before joiners enter the batch
            rest = self._verify_rest(work, verify_rids)
            self.counters["ahead_heads_windows"] += 1
        merged = None
        if joiners:
            for rid in joiners:
                self._quantize(_own_cache(self._rows[rid]))  # a row with nothing to prefill
            try:
                merged = merge_caches([_own_cache(self._rows[rid]) for rid in joiners])
            except Exception as exc:  # noqa: BLE001 - a kind that cannot be batched fails its rows, not the engine
                if isinstance(exc, MemoryError) or _is_oom(exc):
                    raise
                for rid in joiners:
                    res.errors[rid] = f"this model's cache cannot join the decode batch: {exc}"
                    self._rows.pop(rid, None)
                    work.pop(rid, None)
                joiners = []
        if joiners:
            assert merged is not None  # merged whenever joiners are left
            inputs = [work[rid] for rid in joiners]
            group = DecodeBatch()
            group.add(joiners, merged)
            logits = group.forward(self.model, inputs)
            outputs.append(self._sample(joiners, inputs, logits, step_tokens))
            batch.add(joiners, group.cache)
            for rid, toks in zip(joiners, inputs):
                row = self._rows[rid]
                row.cache = None
                row.fed += len(toks)

        # 8. run the next step ahead when every batch row decoded and the kind can undo it
        all_decoded = not verifying and len(batch) > 0 and len(work) == len(batch)
        ahead = None
        fits = all_decoded and self.pipeline and self._ahead_fits()
        if all_decoded and (self._run_ahead_kind_off or (self.pipeline and not fits)):
            self.fallbacks["run_ahead_off"] += 1
        if fits and len(step_tokens) == len(outputs):
            ahead = mx.concatenate(step_tokens) if len(step_tokens) > 1 else step_tokens[0]
        if ahead is None and queued:
            self._undo(queued)
            queued = []
        for q, q_tokens in zip(queued, queued_tokens):
            q.tokens = q_tokens  # without the rows that closed

        if ahead is not None:
            self._queued = queued
            self._due = queued[-1].tokens if queued else ahead
            if len(queued) < self.max_ahead and not self._has_logits():
                # Build the next step's graph now, on this step's still-lazy tokens:
                # the Python of the build overlaps the last kernels of this step
                # (MLX's CPU ``async_eval`` returns with a few tasks still running,
                # which the ``eval`` below waits for), as ``generate_step`` does.
                # The MLX thread computes it once the result is handed over.
                self._build_ahead(pending=1)
        # 9. evaluate and collect: tokens, logprobs, verify targets; caches handed out.
        # Caches handed out are evaluated, so the prompt-cache tiers may copy them
        # from another thread (an unevaluated array is bound to this thread's stream).
        kept = [*res.closed.values(), *res.checkpoints.values()]
        mx.eval(
            [(toks, list(lps.values())) for _, _, toks, lps in outputs],
            [c.state for cache in kept for c in cache],
        )
        for rids, widths, toks, lps in outputs:
            self._collect(rids, widths, toks, lps, verify_rids, res)
        if heads:
            self._join_heads(rest, verify_rids, res)
        if plan.prefill or self.steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        if ahead is not None:
            self._queued_inputs = {rid: res.tokens[rid] for rid in batch.rids}
        return res

    # ---- phases --------------------------------------------------------------
    def _checkpoint(self, plan: StepPlan, res: StepResult) -> None:
        for rid in plan.checkpoint:
            row = self._rows.get(rid)
            if row is not None and row.cache is not None and rid not in res.errors:
                try:
                    res.checkpoints[rid] = snapshot_cache(row.cache)
                except Exception as exc:  # noqa: BLE001 - no checkpoint is a later miss, never a failed row
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    self.fallbacks["checkpoint_failed"] += 1

    def _work(self, plan: StepPlan, res: StepResult) -> dict[int, list[int]]:
        work: dict[int, list[int]] = {}
        for d in plan.decode:
            work[d.rid] = [d.token]
        for v in plan.verify:
            if v.rid in work or not v.tokens:
                res.errors[v.rid] = "a row can decode or verify once per step, with a non-empty window"
                work.pop(v.rid, None)
                continue
            if self._window_fits(v.rid, len(v.tokens)):
                work[v.rid] = list(v.tokens)
            else:
                work[v.rid] = v.tokens[:1]
                self.fallbacks["spec_untrimmable"] += 1
        for rid in list(work):
            if rid not in self._rows:
                res.errors.setdefault(rid, f"row {rid} is not open on the device")
                del work[rid]
        return work

    def _close(self, plan: StepPlan, res: StepResult, queued: list[_Ahead]) -> list[mx.array]:
        """Close rows; return each queued step's tokens for the rows that stay."""
        leaving: list[int] = []
        for rid in plan.close:
            row = self._rows.pop(rid, None)
            if row is None:
                continue
            if row.cache is None:
                leaving.append(rid)
            elif rid in plan.keep_cache:
                res.closed[rid] = row.cache
        tokens = [q.tokens for q in queued]
        if not leaving:
            return tokens
        gone = set(leaving)
        stay = [i for i, rid in enumerate(self._batch.rids) if rid not in gone]
        try:
            kept = self._batch.remove(leaving, plan.keep_cache)
        except Exception:  # noqa: BLE001 - a cache kind that cannot be extracted: a later miss, not an error
            self.fallbacks["keep_cache_failed"] += len(gone & plan.keep_cache)
            kept = self._batch.remove(leaving, set())
        if queued:  # only all-KVCache batches run ahead; SSM state has no trim
            for cache in kept.values():
                for c in cache:
                    c.trim(len(queued))  # tokens fed by steps run ahead were never confirmed
        res.closed.update(kept)
        index = mx.array(stay) if stay else None
        return [t[index] if index is not None else t[:0] for t in tokens]

    def _open(self, plan: StepPlan, res: StepResult) -> None:
        self._refill = {}
        for o in plan.open:
            if o.rid in self._rows:
                res.errors[o.rid] = f"row {o.rid} is already open"
                continue
            if o.cache is None:
                cache, fed = self.make_cache(), 0
            else:
                try:
                    cache, fed = self._open_cache(o.cache, o.cached), o.cached
                except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, not an error
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    if len(o.prefix) != o.cached:  # nothing to prefill instead: this row fails, not the step
                        res.errors[o.rid] = f"prefix cache: {exc}"
                        continue
                    # open it empty and prefill the whole prompt (``_prefill``); the Scheduler logs it
                    self.counters["cache_faults"] += 1
                    res.cache_faults[o.rid] = str(exc)
                    self._refill[o.rid] = list(o.prefix)
                    cache, fed = self.make_cache(), 0
            seed = row_seed(o.sampling, self.engine_seed, o.rid)
            sampler = RowSampler(o.sampling, seed, self.info.vocab_size)
            logits = None
            if needs_processing(o.sampling):
                try:
                    matcher = self.grammars.matcher(o.sampling.constraint) if o.sampling.constraint else None
                except Exception as exc:  # noqa: BLE001 - normally refused at admission (Engine.asubmit)
                    res.errors[o.rid] = f"constraint: {exc}"
                    continue
                logits = RowLogits(o.sampling, matcher, self.info.vocab_size, sorted(self.tokenizer.eos_token_ids))
            self._rows[o.rid] = _Row(o.rid, sampler, o.sampling.max_tokens, cache, fed, logits=logits)

    @staticmethod
    def _open_cache(cache: Any, n: int) -> list[Any]:
        """A row's private cache of ``n`` tokens from what ``OpenRow`` carried:
        a ``CachePrefix`` of a RAM-tier entry is cut here (``prefix_view``), a
        cache holding more tokens trimmed; raises when it cannot serve ``n``."""
        if isinstance(cache, CachePrefix):
            cache = prefix_view(cache.cache, cache.n)
        size = getattr(cache[0], "offset", None)
        if isinstance(size, int) and size != n:
            if size < n or not can_trim_prompt_cache(cache):
                raise ValueError(f"prefix cache holds {size} tokens, not {n}")
            trim_prompt_cache(cache, size - n)
        return cast(list[Any], cache)

    def _trim(self, plan: StepPlan, res: StepResult) -> None:
        batch_trim: dict[int, int] = {}
        for rid, n in plan.trim:
            row = self._rows.get(rid)
            if row is None:
                res.errors.setdefault(rid, f"row {rid} is not open on the device")
                continue
            n = min(n, row.fed)
            if row.cache is not None:
                if n and trim_prompt_cache(row.cache, n) != n:
                    res.errors[rid] = "this model's cache cannot be trimmed"
                    continue
                row.fed -= n
                if row.logits is not None:
                    row.logits.trim(n)
            elif n:
                batch_trim[rid] = batch_trim.get(rid, 0) + n
        if batch_trim:
            if not can_trim_prompt_cache(self._batch.cache):
                for rid in batch_trim:
                    res.errors[rid] = "this model's cache cannot be trimmed"
                return
            self._batch.trim([batch_trim.get(rid, 0) for rid in self._batch.rids])
            for rid, n in batch_trim.items():
                row = self._rows[rid]
                row.fed -= n
                if row.logits is not None:
                    row.logits.trim(n)

    def _window_fits(self, rid: int, n: int) -> bool:
        """Speculation's guard: can the row's cache take an ``n``-token verify
        window and be trimmed back afterwards? Not for SSM/recurrent state, nor
        for a rotating window the tokens would wrap. A window that does not fit
        is cut to its first token (a plain decode, answered with one token), so
        the Verifier falls back instead of a trim failing or corrupting."""
        row = self._rows.get(rid)
        if row is None:
            return True  # reported as "not open" by the step
        cache = row.cache if row.cache is not None else self._batch.cache
        for c in cache:
            if not c.is_trimmable():
                return False
            max_size = getattr(c, "max_size", None)
            if max_size is not None and max(row.fed, int(getattr(c, "_offset", 0) or 0)) + n >= max_size:
                return False
        return True

    def _prefill(self, plan: StepPlan, res: StepResult) -> None:
        vocab = self.info.vocab_size
        ready: list[tuple[_Row, list[int]]] = []
        refill, self._refill = self._refill, {}  # rows whose prefix cache faulted this step: their prefix first
        chunks = [(c.rid, refill.pop(c.rid, []) + c.tokens) for c in plan.prefill]
        chunks += list(refill.items())  # a faulted row with no chunk this step (it decodes next)
        for rid, tokens in chunks:
            row = self._rows.get(rid)
            if row is None or row.cache is None:
                res.errors.setdefault(rid, f"row {rid} cannot prefill (not open, or decoding)")
                continue
            if not tokens:
                continue
            if min(tokens) < 0 or max(tokens) >= vocab:
                res.errors[rid] = "a token id is outside the vocabulary"
                continue
            ready.append((row, tokens))
        # Chunks of rows whose caches hold the same number of tokens go through
        # one forward (mlx_lm.BatchGenerator prefills its prompts together too).
        groups: dict[int, list[tuple[_Row, list[int]]]] = {}
        for row, tokens in ready:
            key = row.fed if self.prefill_together else -1 - row.rid
            groups.setdefault(key, []).append((row, tokens))
        if not self.prefill_together and self._prefill_kind_off:
            shared: dict[int, int] = {}
            for row, _ in ready:
                shared[row.fed] = shared.get(row.fed, 0) + 1
            self.fallbacks["prefill_alone"] += sum(n for n in shared.values() if n > 1)
        for group in groups.values():
            if len(group) == 1:
                row, tokens = group[0]
                cache = _own_cache(row)
                self.model(mx.array(tokens)[None], cache=cache)
                self._quantize(cache)
                mx.eval([c.state for c in cache])
                row.fed += len(tokens)
            elif self._plain_kv:
                self._prefill_together(group)
            else:
                try:
                    self._prefill_merged(group)
                except Exception as exc:  # noqa: BLE001 - a kind whose batch cache fails: prefill alone
                    if isinstance(exc, MemoryError) or _is_oom(exc):
                        raise
                    self.fallbacks["prefill_alone"] += len(group)
                    for row, tokens in group:  # untouched: the merged copy was never handed back
                        own = _own_cache(row)
                        self.model(mx.array(tokens)[None], cache=own)
                        self._quantize(own)
                        mx.eval([c.state for c in own])
                        row.fed += len(tokens)

    def _prefill_merged(self, group: list[tuple[_Row, list[int]]]) -> None:
        """``_prefill_together`` for caches that are not all plain KV (rotating
        windows, SSM state, lists of them), through mlx-lm's batch caches as
        its ``BatchGenerator`` prefills: merge the rows' caches, right-pad the
        shorter chunks (``prepare(lengths=)`` keeps padding out of windows and
        recurrent state), ``finalize``, and ``extract`` each row's cache back."""
        lengths = [len(t) for _, t in group]
        width = max(lengths)
        pad = [width - n for n in lengths]
        cache = merge_caches([_own_cache(row) for row, _ in group])
        if any(pad):
            for c in cache:
                c.prepare(right_padding=pad, lengths=lengths)
        x = mx.array([t + [t[-1]] * (width - len(t)) for _, t in group])
        self.counters["prefill_together"] += len(group)
        self.model(x, cache=cache)
        for c in cache:
            c.finalize()
        mx.eval([c.state for c in cache])
        rows = [[c.extract(i) for c in cache] for i in range(len(group))]  # all, before any row changes
        for (row, tokens), own in zip(group, rows):
            row.cache = own
            self._quantize(row.cache)
            row.fed += len(tokens)

    def _prefill_together(self, group: list[tuple[_Row, list[int]]]) -> None:
        """One ``(B, L)`` forward for B rows at the same cache offset, shorter
        chunks right-padded; causal attention keeps the padding out of every
        real position, whose keys and values are cut back into each row's own
        cache. 8 prompts of 48 tokens: 1.5x (quiet machine) to 4x (loaded)
        faster than eight B=1 forwards (``python -m bench.forward``).
        Not bit for bit the B=1 forward: a GEMM over more rows, and attention
        over a padded length, may take another kernel path, ~1e-6 apart in
        fp32 (the same class as a batched decode or verify step; greedy tokens
        are compared with mlx-lm's in tests/engine/test_mlx_backend.py).
        ``EngineConfig(batch_prefill=False)`` prefills every row alone, bit
        for bit as mlx_lm.generate_step."""
        offset = group[0][0].fed
        width = max(len(t) for _, t in group)
        caches = [_own_cache(r) for r, _ in group]
        batch = [KVCache() for _ in caches[0]]
        if offset:
            for layer, c in enumerate(batch):
                c.state = (
                    mx.concatenate([rc[layer].keys[..., :offset, :] for rc in caches]),
                    mx.concatenate([rc[layer].values[..., :offset, :] for rc in caches]),
                    offset,
                )
        x = mx.array([t + [t[-1]] * (width - len(t)) for _, t in group])
        self.counters["prefill_together"] += len(group)
        self.model(x, cache=batch)
        mx.eval([c.state for c in batch])
        for i, ((row, tokens), own) in enumerate(zip(group, caches)):
            end = offset + len(tokens)
            for layer, c in enumerate(own):
                c.state = (batch[layer].keys[i : i + 1, :, :end, :], batch[layer].values[i : i + 1, :, :end, :], end)
            row.fed = end

    # ---- sampling ------------------------------------------------------------
    def _sample(
        self, rids: list[int], inputs: list[list[int]], logits: mx.array, step_tokens: list[mx.array]
    ) -> tuple[list[int], list[int] | None, Any, dict[int, tuple[mx.array, ...]]]:
        """Sample each row's tokens. A pure decode group gives one ``[B]`` array
        (also appended to ``step_tokens``); otherwise a list of per-row arrays.
        The last item: the lazy logprob arrays of the rows that asked for them."""
        rows = [self._rows[rid] for rid in rids]
        lps: dict[int, tuple[mx.array, ...]] = {}
        if logits.shape[1] == 1 and all(len(x) == 1 for x in inputs):
            toks = self._sample_last(logits, rows, inputs, lps)
            step_tokens.append(toks)
            return list(rids), None, toks, lps
        per_row = []
        widths = [len(x) for x in inputs]
        for i, (row, n) in enumerate(zip(rows, widths)):
            if n == 0:
                per_row.append(mx.zeros((0,), mx.uint32))
                continue
            raw = logits[i, :n, :]
            lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
            if row.logits is None:
                per_row.append(row.sampler(lp))
                continue
            toks = row.sampler(row.logits.window(inputs[i], raw))
            if row.logits.logprobs is not None:
                lps[row.rid] = row.logits.logprob_arrays(lp, toks)
            per_row.append(toks)
        return list(rids), widths, per_row, lps

    def _sample_last(
        self,
        logits: mx.array,
        rows: list[_Row],
        inputs: list[list[int]] | None = None,
        lps: dict[int, tuple[mx.array, ...]] | None = None,
    ) -> mx.array:
        raw = logits[:, -1, :]
        lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
        procs = [i for i, r in enumerate(rows) if r.logits is not None]
        if not procs:
            if all(r.sampler.greedy for r in rows):
                return mx.argmax(lp, axis=-1)
            return mx.concatenate([r.sampler(lp[i : i + 1]) for i, r in enumerate(rows)])
        # Rows with logits processing (engine.mlx.logits), batched: processors per
        # row, then every row's grammar mask in one [B, V] op.
        assert inputs is not None  # given whenever a row has processing
        for i in procs:
            _row_logits(rows[i]).feed(inputs[i][0])
        x = raw
        if any(_row_logits(rows[i]).processors for i in procs):
            x = mx.concatenate(
                [r.logits.apply_processors(x[i : i + 1]) if r.logits else x[i : i + 1] for i, r in enumerate(rows)]
            )
        masked = [i for i in procs if _row_logits(rows[i]).matcher is not None]
        if masked:
            words = np.full((len(rows), (self.info.vocab_size + 31) // 32), -1, np.int32)
            for i in masked:
                _row_logits(rows[i]).mask_words(words[i])
            x = apply_words(x, words, self.info.vocab_size)
        plp = x - mx.logsumexp(x, axis=-1, keepdims=True)  # == lp for the rows without processing
        if all(r.sampler.greedy for r in rows):
            toks = mx.argmax(plp, axis=-1)
        else:
            toks = mx.concatenate([r.sampler(plp[i : i + 1]) for i, r in enumerate(rows)])
        for i in procs:
            row_logits = _row_logits(rows[i])
            if row_logits.logprobs is not None:
                assert lps is not None  # given whenever a row wants logprobs
                lps[rows[i].rid] = row_logits.logprob_arrays(lp[i : i + 1], toks[i : i + 1])
        return toks

    def _has_logits(self) -> bool:
        """A batch row with processing: its next mask or penalty needs the token
        just sampled on the host, so its next step is built only after this
        one's tokens are read (in ``run_ahead``, not inside ``step``)."""
        return any(self._rows[rid].logits is not None for rid in self._batch.rids)

    def _collect(
        self,
        rids: list[int],
        widths: list[int] | None,
        toks: Any,
        lps: dict[int, tuple[mx.array, ...]],
        verify_rids: set[int],
        res: StepResult,
    ) -> None:
        if widths is None:
            for rid, t in zip(rids, toks.tolist()):
                res.tokens[rid] = t
                self._rows[rid].emitted += 1
                if rid in lps:
                    res.logprobs[rid] = to_token_logprobs([t], lps[rid])
            return
        for rid, n, arr in zip(rids, widths, toks):
            if n == 0:
                continue
            if rid in verify_rids:
                res.verified[rid] = arr.tolist()
            else:
                res.tokens[rid] = arr.item()
                self._rows[rid].emitted += 1
                if rid in lps:
                    res.logprobs[rid] = to_token_logprobs([res.tokens[rid]], lps[rid])

    # ---- running ahead -------------------------------------------------------
    def run_ahead(self, idle: Callable[[], bool] = lambda: False) -> None:
        """Compute the batch's next decode step(s) while nobody waits for the device.

        ``MLXThread`` calls this right after it has handed a step's result to the
        event loop, so the forward runs while the loop works on that result (on
        MLX's CPU backend ``async_eval`` computes most of a decode graph before
        it returns, so queueing inside ``step`` would delay the result instead).
        Up to ``max_ahead`` steps: the first whenever one is due, more only
        while ``idle()`` says no call is waiting. On a device that never calls
        this, nothing runs ahead.
        """
        with mx.stream(generation_stream):
            try:
                if self._built is not None:
                    built, self._built = self._built, None
                    mx.async_eval(built)
                while idle() and self._due is not None and len(self._queued) < self.max_ahead:
                    self._build_ahead()
                    if self._built is not None:
                        built, self._built = self._built, None
                        mx.async_eval(built)
            except Exception as exc:  # noqa: BLE001 - the next step raises it
                self._due = self._built = None
                self._ahead_error = exc

    def _build_ahead(self, pending: int = 0) -> None:
        """Queue the graph of the batch's next decode step (computed later by
        ``run_ahead``, or when a step reads it). ``pending``: tokens each row has
        sampled but not yet counted in ``emitted`` (the step being finished)."""
        batch, tokens = self._batch, self._due
        assert tokens is not None  # called only with a step due
        rows = [self._rows[rid] for rid in batch.rids]
        depth = len(self._queued) + pending
        if not self._ahead_fits():
            self._due = None  # a window that would wrap could not give the step back
            return
        if all(r.emitted + depth >= r.max_tokens for r in rows):
            self._due = None  # every row has all its tokens by then
            return
        keys = [(r, r.sampler.key) for r in rows if r.sampler.key is not None]  # the sampled (not greedy) rows
        inputs: list[list[int]] | None = None
        lps: dict[int, tuple[mx.array, ...]] = {}
        fed = [r for r in rows if r.logits is not None]
        if fed:  # masks and penalties need the inputs on the host
            inputs = [[t] for t in cast(list[int], tokens.tolist())]
        logits = batch.decode(self.model, tokens)
        nxt = self._sample_last(logits, rows, inputs, lps)
        self._queued.append(_Ahead(nxt, keys, fed, lps))
        self._due = self._built = nxt

    def _ahead_fits(self) -> bool:
        """Can the batch take one more decode step and give it back (``trim``)?
        A sliding window can while its ring has not wrapped: up to then mlx-lm's
        ``BatchRotatingKVCache`` is laid out, and trims, like a plain one."""
        for c in self._batch.cache:
            if type(c) is BatchRotatingKVCache and (c.rotated or c._idx >= c.max_size):
                return False
        return True

    def _queue_fits(self, plan: StepPlan) -> bool:
        """Does the plan decode exactly the batch's rows with the tokens the
        oldest step run ahead fed?"""
        closed = set(plan.close)
        batch = self._batch
        if any(v.rid in batch for v in plan.verify) or any(rid in batch and rid not in closed for rid, _ in plan.trim):
            return False
        fed = {d.rid: d.token for d in plan.decode if d.rid in batch}
        stay = [rid for rid in batch.rids if rid not in closed]
        want = self._queued_inputs
        return len(fed) == len(stay) and all(fed.get(rid) == want.get(rid) for rid in stay)

    # ---- speculation: a verify window after a step run ahead --------------------
    def _queue_heads_windows(self, plan: StepPlan, queued: list[_Ahead]) -> bool:
        """Can the one decode step run ahead serve as the first position of this
        plan's verify windows? It fed each row exactly the token a window starts
        with (``last``), so its sampled token is the target's token at position
        0; the window's drafts are then fed on top instead of undoing it (a
        whole wasted decode every time a row turns from plain decode to
        speculation). Only with one step ahead, no trims and no other inputs."""
        batch = self._batch
        closed = set(plan.close)
        if len(queued) != 1 or any(rid in batch and rid not in closed for rid, _ in plan.trim) or self._has_logits():
            return False
        first = {d.rid: d.token for d in plan.decode if d.rid in batch}
        windows = {v.rid: v.tokens[0] for v in plan.verify if v.rid in batch and v.tokens}
        if not windows or set(first) & set(windows):
            return False
        first.update(windows)
        stay = [rid for rid in batch.rids if rid not in closed]
        want = self._queued_inputs
        return len(first) == len(stay) and all(first.get(rid) == want.get(rid) for rid in stay)

    def _verify_rest(self, work: dict[int, list[int]], verify_rids: set[int]) -> tuple[list[int], Any] | None:
        """Feed the verify rows' drafts (their windows past the first token, which
        the step run ahead fed) in one batched forward; the other rows feed nothing."""
        batch = self._batch
        inputs = [work.get(rid, [])[1:] if rid in verify_rids else [] for rid in batch.rids]
        if not any(inputs):
            return None
        logits = batch.forward(self.model, inputs)
        rids = list(batch.rids)
        _, widths, toks, _ = self._sample(rids, inputs, logits, [])
        for rid, x in zip(rids, inputs):
            self._rows[rid].fed += len(x)
        mx.eval(toks)
        return rids, (widths, toks)

    @staticmethod
    def _join_heads(rest: tuple[list[int], Any] | None, verify_rids: set[int], res: StepResult) -> None:
        """Verify rows: the head token from the step run ahead, then their drafts'."""
        per_row: dict[int, list[int]] = {}
        if rest is not None:
            rids, (widths, toks) = rest
            if widths is None:  # every row fed exactly one draft: one [B] array
                per_row = {rid: [t] for rid, t in zip(rids, toks.tolist())}
            else:
                per_row = {rid: arr.tolist() for rid, n, arr in zip(rids, widths, toks) if n}
        for rid in verify_rids:
            if rid in res.tokens:
                res.verified[rid] = [res.tokens.pop(rid), *per_row.get(rid, [])]

    def _undo(self, queued: list[_Ahead]) -> None:
        """Take back steps run ahead: their tokens leave the cache, keys go back."""
        for c in self._batch.cache:
            c.trim(len(queued))
        for row, key in queued[0].keys:
            row.sampler.key = key
        for q in queued:
            for row in q.fed:
                _row_logits(row).trim(1)
        self.counters["undone"] += len(queued)

    # ---- introspection (tests, stats) ------------------------------------------
    def row_cache(self, rid: int) -> list[Any]:
        """A row's cache as it would be kept on close (a copy for batch rows)."""
        row = self._rows[rid]
        if row.cache is not None:
            return row.cache
        i = self._batch.index(rid)
        cache = [c.extract(i) for c in self._batch.cache]
        for c in cache:
            extra = getattr(c, "offset", row.fed) - row.fed
            if extra:
                c.trim(extra)  # steps run ahead are not the row's yet
        return cache

    def stats(self) -> dict[str, Any]:
        return {
            "rows": len(self._rows),
            "batch": len(self._batch),
            "pipeline": self.pipeline,
            **self.counters,
            "fallbacks": dict(self.fallbacks),
        }
