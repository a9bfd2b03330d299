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

# The step's phases live in one module each, as classes over the state they
# share (``engine.mlx.state``): ``cache_ops`` (make, quantize, trim, open a
# row's cache), ``row_phases`` (close, open, trim, checkpoint, the step's
# work), ``prefill``, ``step_sampling`` and ``run_ahead``; the model's loading
# and ``ModelInfo`` in ``loading``. ``MLXBackend`` composes them and keeps
# what orders them: ``__init__``, ``load`` and the numbered ``_step``.
from __future__ import annotations

import pathlib
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from engine.config import EngineConfig
from engine.device import ThreadDevice
from engine.mlx import buffer_cache, lora, qmm_linear, softmax_kernel, split_attention
from engine.mlx.batch import DecodeBatch, merge_caches
from engine.mlx.blas import blas_threads
from engine.mlx.cpu_layout import SMALL_FORWARD_ROWS, CpuChoice
from engine.mlx.device import MLXThread
from engine.mlx.grammar import Grammars
from engine.mlx.loading import model_info, pretransposed_linears, read_model
from engine.mlx.model_identity import tokenizer_hash
from engine.mlx.prefill import Prefill
from engine.mlx.row_phases import RowPhases
from engine.mlx.rows import _is_oom, _own_cache
from engine.mlx.run_ahead import RunAhead
from engine.mlx.tokenizer import MLXTokenizer
from engine.mlx.warm_up import decode_step_s, warm_up
from engine.ports import StepPlan, StepResult

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


class MLXBackend(RunAhead, Prefill, RowPhases):
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
        self.attention_parts = 1  # MLXBackend.load sets it on MLX's CPU backend
        self.softmax_kernel: Any = None  # and this (engine.mlx.softmax_kernel), where it builds
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
        self.can_checkpoint = True  # any row, on request (RowPhases._checkpoint)
        self.info = model_info(
            model,
            tokenizer,
            config,
            probe,
            vocab_fallback=lambda: len(self.tokenizer),
            model_id=model_id,
            tokenizer_hash=tokenizer_hash,
            weights_digest=weights_digest,
            max_kv_size=max_kv_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )
        self._rows = {}
        self._batch = DecodeBatch()
        self.grammars = Grammars(
            getattr(tokenizer, "_tokenizer", tokenizer), self.info.vocab_size, sorted(self.tokenizer.eos_token_ids)
        )
        # Decode steps computed ahead of the Scheduler at most. One: deeper runs
        # measured slower, as their graph building holds the GIL the event loop
        # needs and a plan that arrives waits for the forward in progress.
        self.max_ahead = 1
        self._queued = []  # steps computed ahead, oldest first
        self._queued_inputs = {}  # what the oldest one fed: the last tokens returned
        self._due = None  # inputs of the next step to run ahead
        self._built = None  # a step built ahead, not yet being computed
        self._ahead_error = None
        self.steps = 0
        self.counters = {
            "pipelined": 0,
            "undone": 0,
            "ahead_heads_windows": 0,
            "windows_stopped": 0,  # verify rows stopped at a rejected first draft (StepResult.stopped)
            "prefill_together": 0,
            "cache_faults": 0,
        }
        self._refill = {}  # rid -> prefix to prefill: its prefix cache faulted (``_open``)
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
        self.adapters = lora.Adapters()

    @classmethod
    def load(cls, path: pathlib.Path, config: EngineConfig) -> MLXBackend:
        loaded = read_model(path, config)
        qmm_in_graph = qmm_linear.in_graph()  # the quantized kernels are MLX primitives (engine.mlx.mlx_ops)
        backend = cls(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            model_id=config.model_name or str(config.model),
            tokenizer_hash=tokenizer_hash(path),
            engine_seed=config.seed,
            weights_digest=loaded.weights_digest,
            prefill_together=config.batch_prefill,
            max_kv_size=config.max_kv_size,
            kv_bits=config.kv_bits,
            kv_group_size=config.kv_group_size,
            # A model whose quantized layers take the C kernel from Python
            # evaluates each layer's input as its graph is built, so a step built
            # ahead is computed inside the step that builds it: no overlap with the
            # event loop, a verify after plain steps paid as two passes over the
            # weights (the step run ahead, then the drafts), and a plain step
            # after a verify costing two forwards, which adaptive γ then took
            # for a plain round's price (docs/bench/spec-real.md). As MLX
            # primitives (engine.mlx.mlx_ops) its decode calls build lazily again.
            pipeline=not (loaded.qmm_layers and not qmm_in_graph),
        )
        backend.counters["pretransposed_linears"] = pretransposed_linears(loaded.model)
        if loaded.cpu_choice is not None:  # MLX's CPU backend
            backend.counters["buffer_cache_mib"] = buffer_cache.raise_limit() >> 20
            backend.attention_parts = config.attention_streams or split_attention.default_parts()
            if config.softmax_kernel:
                backend.softmax_kernel = softmax_kernel.load()
            wants = backend.attention_parts > 1 or backend.softmax_kernel is not None
            if wants and not split_attention.install(loaded.model):
                # a model that does not call mlx-lm's attention function
                backend.attention_parts, backend.softmax_kernel = 1, None
        backend.counters["attention_streams"] = backend.attention_parts
        backend.counters["softmax_kernel"] = int(backend.softmax_kernel is not None)
        backend.counters["qmm_kernel_layers"] = loaded.qmm_layers  # engine.mlx.qmm_kernel, installed by read_model
        backend.counters["qmm_in_graph"] = int(bool(loaded.qmm_layers) and qmm_in_graph)
        backend.counters["qmm_dot_gemm_rows"] = qmm_linear.dot_rows() if loaded.qmm_layers else 0
        backend.counters["fmm_kernel_layers"] = loaded.fmm_layers  # engine.mlx.fmm_linear, installed by read_model
        if loaded.cpu_choice is not None:
            backend.cpu_threads = loaded.cpu_choice
            backend.cpu_choice = loaded.cpu_choice.as_dict()
            # first use (OpenBLAS threads, the split's streams, the kernel, the
            # buffer cache) paid here, not by the first request (issue #45)
            backend.counters["warm_up_ms"] = round(
                warm_up(loaded.model, backend.attention_parts, backend.softmax_kernel) * 1e3
            )
        for spec in config.adapters:  # last: the layout above measured the base linears
            backend.adapters.load(loaded.model, spec)
        backend.counters["lora_stacks"] = backend.adapters.stacks
        return backend

    def step_cost_s(self, plan: StepPlan) -> float:
        return 0.0

    def decode_step_s(self) -> float:
        """Seconds of a one-row decode step, timed on a throwaway cache (on the
        MLX thread): adaptive γ's measure of the target before any round ran."""
        self.blas.use(self.cpu_threads.threads_for(1))
        return decode_step_s(self.model, self.attention_parts, self.softmax_kernel)

    def greedy_next(self, tokens: list[int]) -> list[int]:
        """The model's argmax after each prefix of ``tokens``: one forward on a
        throwaway cache (on the MLX thread). Adaptive γ's acceptance prior for a
        draft model compares it with the drafter's (``ember.spec_build``)."""
        from mlx_lm.models.cache import make_prompt_cache

        with mx.stream(generation_stream), split_attention.parts(self.attention_parts, self.softmax_kernel):
            logits = self.model(mx.array(tokens)[None], cache=make_prompt_cache(self.model))
            out: list[int] = mx.argmax(logits[0], axis=-1).astype(mx.int32).tolist()  # type: ignore[assignment]
            return out

    # ---- the step ------------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        with mx.stream(generation_stream), split_attention.parts(self.attention_parts, self.softmax_kernel):
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
        head_tokens = None
        if queued:
            for rid in batch.rids:
                self._rows[rid].fed += 1
            head_tokens = queued_tokens[0]
            outputs.append((list(batch.rids), None, head_tokens, queued.pop(0).logprobs or {}))
            step_tokens.append(head_tokens)
            queued_tokens = queued_tokens[1:]
            self.counters["pipelined"] += 1
            if joiners and queued:
                self._undo(queued)  # computed without the rows joining now
                queued, queued_tokens = [], []
        elif any(rid in batch for rid in work):
            inputs = [work.get(rid, []) for rid in batch.rids]
            with self._lora(self._rows[rid] for rid in batch.rids):
                logits = batch.forward(self.model, inputs)
            outputs.append(self._sample(batch.rids, inputs, logits, step_tokens))
            for rid, toks in zip(batch.rids, inputs):
                self._rows[rid].fed += len(toks)  # else a later trim is clipped to a stale `fed`
        rest = None
        if heads:  # before joiners enter the batch
            assert head_tokens is not None  # heads only with a step run ahead
            rest, stopped = self._verify_rest(work, verify_rids, cast(list[int], head_tokens.tolist()))
            res.stopped |= stopped
            self.counters["ahead_heads_windows"] += 1
            self.counters["windows_stopped"] += len(stopped)
            # Every batch row's window stopped at its first draft: the batch was
            # fed one token a row, a plain decode step, and the next may run
            # ahead (unless a row joining now verifies a window).
            verifying = rest is not None or bool(verify_rids - set(batch.rids))
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
            with self._lora(self._rows[rid] for rid in joiners):
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
        if ahead is not None:  # before the heads' tokens move to ``verified``
            self._queued_inputs = {rid: res.tokens[rid] for rid in batch.rids}
        if heads:
            self._join_heads(rest, verify_rids, res)
        if plan.prefill or self.steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return res

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
