"""The MLX backend: ``engine.ports.Backend`` on an mlx-lm model.

Every method runs on one dedicated thread (``engine.mlx_device.MLXThread``, a
``ThreadDevice``), which owns MLX: loading, forwards, cache surgery. Any mlx-lm model directory
works; a "cache" is an mlx-lm prompt cache (``make_prompt_cache(model)``).

Why not ``mlx_lm.BatchGenerator``. It is a scheduler of its own: it decides
when prompts are admitted and how they are chunked, applies stop tokens and
max_tokens, and has no per-row trim or verify. Our Scheduler already makes
those decisions and hands the device one explicit ``StepPlan`` per step, so
the backend reuses the layer below BatchGenerator, mlx-lm's batch caches
(``merge``/``extend``/``extract``/``filter``/``prepare``/``finalize``, see
``engine.mlx_batch``), and its sampling filters (``engine.mlx_sampling``).

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
  models whose caches are all plain ``KVCache`` (trimmable).
* Verify (``VerifyRow``): the window goes through the same batched forward;
  rows with shorter windows (decode rows: 1 token) are right-padded and the
  padding is rolled away, and every position's token is returned. Trims after
  a verify are per row (``DecodeBatch.trim``). This is the seam for
  speculative decoding; nothing runs ahead after a verify step. When windows
  follow a step run ahead whose inputs were their first tokens, that step is
  kept as the windows' first position and only the drafts are fed
  (``_queue_heads_windows``), instead of undoing a whole decode.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from engine.blas import blas_threads
from engine.cpu_layout import PretransposedLinear, calibrate, wants_pretranspose
from engine.config import EngineConfig
from engine.device import ThreadDevice
from engine.mlx_device import MLXThread
from engine.mlx_batch import DecodeBatch, merge_caches
from engine.mlx_sampling import RowSampler, row_seed
from engine.mlx_tokenizer import MLXTokenizer
from engine.ports import ModelInfo, StepPlan, StepResult

log = logging.getLogger("ember.mlx")

# config.json keys that describe the checkpoint, not the computation graph.
_METADATA_KEYS = frozenset(
    {"_name_or_path", "architectures", "transformers_version", "bos_token_id", "eos_token_id",
     "pad_token_id", "use_cache", "generation_config", "tokenizer_class"}
)
DEFAULT_CONTEXT = 4096
CLEAR_CACHE_EVERY = 256  # steps; as generate_step, to hand freed buffers back
# Forwards of at most this many token rows run on one OpenBLAS thread (engine.blas):
# a 1-row decode, and a batch-1 verify window up to γ = 4 (switching the count
# between a plain step and a verify step cost more than 2 threads gained on a
# 5-row window: sims.bench_spec, docs/bench-spec.md).
SINGLE_THREAD_ROWS = 5  # their thread count: MLXBackend.small_threads, measured at load


def load_mlx_backend(config: EngineConfig) -> tuple["MLXBackend", ThreadDevice]:
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


def _config_fingerprint(config: dict[str, Any], kv_scheme: list[str]) -> str:
    graph = {k: v for k, v in config.items() if k not in _METADATA_KEYS}
    blob = json.dumps({"config": graph, "kv": kv_scheme}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _weights_digest(path: pathlib.Path, block: int = 1 << 16) -> str:
    """A cheap identity of the weight files: names, sizes and three sampled blocks
    of each (start — the safetensors header —, middle, end). Retrained weights
    with an unchanged config must not reuse SSD entries made by the old ones,
    and hashing every byte of a multi-GB model at each start would be slow."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for at in (0, max(0, size // 2 - block // 2), max(0, size - block)):
                fh.seek(at)
                h.update(fh.read(block))
    return h.hexdigest()[:16]


def _tokenizer_hash(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    names = ["tokenizer.json"] if (path / "tokenizer.json").is_file() else sorted(
        p.name for p in path.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "spiece"))
    )
    for name in names:
        h.update(name.encode())
        h.update((path / name).read_bytes())
    return h.hexdigest()[:16]


def _context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for cfg in (config, config.get("text_config") or {}):
        n = cfg.get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10_000_000 else DEFAULT_CONTEXT


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


@dataclass(slots=True)
class _Ahead:
    """A decode step of the whole batch computed ahead (see the module docstring)."""

    tokens: mx.array  # [B] its sampled tokens, in batch order
    keys: list[tuple[_Row, mx.array]]  # the sampled rows' PRNG keys before it, to undo it


@dataclass(frozen=True)
class CachePrefix:
    """The first ``n`` positions of a stored cache, as ``PromptCache.take``
    hands them out on the event loop: the slices are cut by ``prefix_view``
    when the row opens on the MLX thread (MLX's streams belong to the thread
    that made them; an op built on the loop cannot run on the MLX thread)."""

    cache: list[Any]
    n: int


def prefix_view(cache: list[Any], n: int) -> list[Any]:
    """A private cache of the first ``n`` positions of a stored one, with
    nothing copied or evaluated yet. Each ``KVCache`` gets lazy slices of the stored arrays;
    the row's first forward on the MLX thread copies them as it writes
    (MLX never writes into a buffer another array still holds, so the
    stored entry stays as it was; tested). The copy the prompt cache used
    to take evaluated the whole entry on the loop and then trimmed it: 7-17 ms
    for an 8k-token entry of the bundled model, a stall of every stream on
    every hit, however few of its tokens the hit reused. Other cache kinds
    are copied whole and trimmed to ``n``."""
    out: list[Any] = []
    for c in cache:
        if type(c) is KVCache:
            view = KVCache()
            if c.keys is not None and n > 0:
                if n > c.offset:
                    raise ValueError(f"the cache holds {c.offset} tokens, not {n}")
                view.keys, view.values, view.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            out.append(view)
            continue
        c = copy.deepcopy(c)
        size = getattr(c, "offset", None)
        if isinstance(size, int) and size != n:
            if size < n or not c.is_trimmable() or c.trim(size - n) != size - n:
                raise ValueError(f"a {type(c).__name__} holding {size} tokens cannot serve {n}")
        out.append(c)
    return out


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
    ):
        self.model = model
        self.tokenizer = MLXTokenizer(tokenizer)
        self.blas = blas_threads()
        self.small_threads = 1  # OpenBLAS threads for small forwards; measured per model at load (cpu_layout.calibrate)
        self.cpu_choice: dict[str, Any] = {}
        self.engine_seed = engine_seed
        probe = make_prompt_cache(model)
        self.pipeline = pipeline and all(type(c) is KVCache for c in probe)
        # rows prefilling together are split back into plain KVCaches
        self.prefill_together = prefill_together and all(type(c) is KVCache for c in probe)
        floats = (v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        first = next(floats, None)
        kv_scheme = [type(c).__name__ for c in probe] + [str(first.dtype if first is not None else "")]
        if weights_digest:
            kv_scheme.append(f"weights:{weights_digest}")
        text_cfg = config.get("text_config") or {}
        vocab = config.get("vocab_size") or text_cfg.get("vocab_size") or len(self.tokenizer)
        self.info = ModelInfo(
            model_id=model_id,
            vocab_size=int(vocab),
            context_length=_context_length(config, tokenizer),
            config_fingerprint=_config_fingerprint(config, kv_scheme),
            tokenizer_hash=tokenizer_hash,
            num_layers=len(getattr(model, "layers", probe)),
        )
        self._rows: dict[int, _Row] = {}
        self._batch = DecodeBatch()
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
        self.counters = {"pipelined": 0, "undone": 0, "ahead_heads_windows": 0, "prefill_together": 0}

    @classmethod
    def load(cls, path: pathlib.Path, config: EngineConfig) -> "MLXBackend":
        from mlx_lm import load

        model, tokenizer, model_config = load(str(path), return_config=True)
        choice = None
        if wants_pretranspose():  # MLX's CPU backend: layout and thread count measured on this model
            choice = calibrate(model, blas_threads(), allow_pretranspose=config.cpu_pretranspose)
            log.info("[mlx] CPU choices for %s: %s", path.name, choice.as_dict())
        backend = cls(
            model,
            tokenizer,
            model_config,
            model_id=config.model_name or str(config.model),
            tokenizer_hash=_tokenizer_hash(path),
            engine_seed=config.seed,
            weights_digest=_weights_digest(path),
            prefill_together=config.batch_prefill,
        )
        backend.counters["pretransposed_linears"] = sum(type(m) is PretransposedLinear for _, m in model.named_modules())
        if choice is not None:
            backend.small_threads = choice.small_threads
            backend.cpu_choice = choice.as_dict()
        return backend

    # ---- caches --------------------------------------------------------------
    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def cache_nbytes(self, cache: list[Any]) -> int:
        """Bytes of the tokens in use; mlx-lm's ``nbytes`` counts the 256-step capacity."""
        total = 0
        for c in cache:
            keys, offset = getattr(c, "keys", None), getattr(c, "offset", None)
            if isinstance(keys, mx.array) and isinstance(offset, int) and keys.shape[2]:
                values = c.values
                total += (keys.nbytes // keys.shape[2] + values.nbytes // values.shape[2]) * offset
            else:
                total += c.nbytes
        return total

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
        res = StepResult()
        self.steps += 1
        width = len(plan.decode) + sum(len(v.tokens) for v in plan.verify)
        self.blas.use(self.small_threads if not plan.prefill and width <= SINGLE_THREAD_ROWS else 0)
        self._due = self._built = None  # without the run-ahead hook a built step is computed when read
        if self._ahead_error is not None:
            exc, self._ahead_error = self._ahead_error, None
            raise exc
        queued, self._queued = self._queued, []
        heads = False  # the step run ahead is the first position of this step's verify windows
        if queued and not self._queue_fits(plan):
            heads = self._queue_heads_windows(plan, queued)
            if not heads:
                self._undo(queued)
                queued = []
        queued_tokens = self._close(plan, res, queued)
        self._open(plan, res)
        self._trim(plan, res)
        self._prefill(plan, res)

        work: dict[int, list[int]] = {}
        for d in plan.decode:
            work[d.rid] = [d.token]
        for v in plan.verify:
            if v.rid in work or not v.tokens:
                res.errors[v.rid] = "a row can decode or verify once per step, with a non-empty window"
                work.pop(v.rid, None)
                continue
            work[v.rid] = list(v.tokens) if self._window_fits(v.rid, len(v.tokens)) else v.tokens[:1]
        verify_rids = {v.rid for v in plan.verify}
        for rid in list(work):
            if rid not in self._rows:
                res.errors.setdefault(rid, f"row {rid} is not open on the device")
                del work[rid]
        batch = self._batch
        joiners = [rid for rid in work if self._rows[rid].cache is not None]
        verifying = bool(plan.verify)

        outputs: list[tuple[list[int], list[int] | None, Any]] = []  # (rids, widths, tokens)
        step_tokens: list[mx.array] = []  # [B] per group, for the next queued step
        if queued:
            queued.pop(0)  # this step's result
            for rid in batch.rids:
                self._rows[rid].fed += 1
            outputs.append((list(batch.rids), None, queued_tokens[0]))
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
        if joiners:
            inputs = [work[rid] for rid in joiners]
            group = DecodeBatch()
            group.add(joiners, merge_caches([self._rows[rid].cache for rid in joiners]))
            logits = group.forward(self.model, inputs)
            outputs.append(self._sample(joiners, inputs, logits, step_tokens))
            batch.add(joiners, group.cache)
            for rid, toks in zip(joiners, inputs):
                row = self._rows[rid]
                row.cache = None
                row.fed += len(toks)

        all_decoded = not verifying and len(batch) > 0 and len(work) == len(batch)
        ahead = None
        if self.pipeline and all_decoded and len(step_tokens) == len(outputs):
            ahead = mx.concatenate(step_tokens) if len(step_tokens) > 1 else step_tokens[0]
        if ahead is None and queued:
            self._undo(queued)
            queued = []
        for q, toks in zip(queued, queued_tokens):
            q.tokens = toks  # without the rows that closed

        if ahead is not None:
            self._queued = queued
            self._due = queued[-1].tokens if queued else ahead
            if len(queued) < self.max_ahead:
                # Build the next step's graph now, on this step's still-lazy tokens:
                # the Python of the build overlaps the last kernels of this step
                # (MLX's CPU ``async_eval`` returns with a few tasks still running,
                # which the ``eval`` below waits for), as ``generate_step`` does.
                # The MLX thread computes it once the result is handed over.
                self._build_ahead(pending=1)
        # Caches handed out are evaluated, so the prompt-cache tiers may copy them
        # from another thread (an unevaluated array is bound to this thread's stream).
        mx.eval([toks for _, _, toks in outputs], [c.state for cache in res.closed.values() for c in cache])
        for rids, widths, toks in outputs:
            self._collect(rids, widths, toks, verify_rids, res)
        if heads:
            self._join_heads(rest, verify_rids, res)
        if plan.prefill or self.steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        if ahead is not None:
            self._queued_inputs = {rid: res.tokens[rid] for rid in batch.rids}
        return res

    # ---- phases --------------------------------------------------------------
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
        kept = self._batch.remove(leaving, plan.keep_cache)
        for cache in kept.values():
            for c in cache:
                c.trim(len(queued))  # tokens fed by steps run ahead were never confirmed
        res.closed.update(kept)
        index = mx.array(stay) if stay else None
        return [t[index] if index is not None else t[:0] for t in tokens]

    def _open(self, plan: StepPlan, res: StepResult) -> None:
        for o in plan.open:
            if o.rid in self._rows:
                res.errors[o.rid] = f"row {o.rid} is already open"
                continue
            if o.cache is None:
                cache, fed = self.make_cache(), 0
            else:
                cache, fed = o.cache, o.cached
                if isinstance(cache, CachePrefix):
                    try:
                        cache = prefix_view(cache.cache, cache.n)
                    except Exception as exc:  # noqa: BLE001 - this row fails, not the step
                        res.errors[o.rid] = f"prefix cache: {exc}"
                        continue
                size = getattr(cache[0], "offset", None)
                if isinstance(size, int) and size != fed:
                    if size < fed or not can_trim_prompt_cache(cache):
                        res.errors[o.rid] = f"prefix cache holds {size} tokens, not {fed}"
                        continue
                    trim_prompt_cache(cache, size - fed)
            seed = row_seed(o.sampling, self.engine_seed, o.rid)
            sampler = RowSampler(o.sampling, seed, self.info.vocab_size)
            self._rows[o.rid] = _Row(o.rid, sampler, o.sampling.max_tokens, cache, fed)

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
            elif n:
                batch_trim[rid] = batch_trim.get(rid, 0) + n
        if batch_trim:
            if not can_trim_prompt_cache(self._batch.cache):
                for rid in batch_trim:
                    res.errors[rid] = "this model's cache cannot be trimmed"
                return
            self._batch.trim([batch_trim.get(rid, 0) for rid in self._batch.rids])
            for rid, n in batch_trim.items():
                self._rows[rid].fed -= n

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
        for chunk in plan.prefill:
            row = self._rows.get(chunk.rid)
            if row is None or row.cache is None:
                res.errors.setdefault(chunk.rid, f"row {chunk.rid} cannot prefill (not open, or decoding)")
                continue
            if not chunk.tokens:
                continue
            if min(chunk.tokens) < 0 or max(chunk.tokens) >= vocab:
                res.errors[chunk.rid] = "a token id is outside the vocabulary"
                continue
            ready.append((row, chunk.tokens))
        # Chunks of rows whose caches hold the same number of tokens go through
        # one forward (mlx_lm.BatchGenerator prefills its prompts together too).
        groups: dict[int, list[tuple[_Row, list[int]]]] = {}
        for row, tokens in ready:
            key = row.fed if self.prefill_together else -1 - row.rid
            groups.setdefault(key, []).append((row, tokens))
        for group in groups.values():
            if len(group) == 1:
                row, tokens = group[0]
                self.model(mx.array(tokens)[None], cache=row.cache)
                mx.eval([c.state for c in row.cache])
                row.fed += len(tokens)
            else:
                self._prefill_together(group)

    def _prefill_together(self, group: list[tuple[_Row, list[int]]]) -> None:
        """One ``(B, L)`` forward for B rows at the same cache offset, shorter
        chunks right-padded; causal attention keeps the padding out of every
        real position, whose keys and values are cut back into each row's own
        cache. 8 prompts of 48 tokens: 1.5x (quiet machine) to 4x (loaded)
        faster than eight B=1 forwards (``python -m sims.bench_forward``).
        Not bit for bit the B=1 forward: a GEMM over more rows, and attention
        over a padded length, may take another kernel path, ~1e-6 apart in
        fp32 (the same class as a batched decode or verify step; greedy tokens
        are compared with mlx-lm's in tests/test_mlx_backend.py).
        ``EngineConfig(batch_prefill=False)`` prefills every row alone, bit
        for bit as mlx_lm.generate_step."""
        offset = group[0][0].fed
        width = max(len(t) for _, t in group)
        batch = [KVCache() for _ in group[0][0].cache]
        if offset:
            for layer, c in enumerate(batch):
                c.state = (
                    mx.concatenate([r.cache[layer].keys[..., :offset, :] for r, _ in group]),
                    mx.concatenate([r.cache[layer].values[..., :offset, :] for r, _ in group]),
                    offset,
                )
        x = mx.array([t + [t[-1]] * (width - len(t)) for _, t in group])
        self.counters["prefill_together"] += len(group)
        self.model(x, cache=batch)
        mx.eval([c.state for c in batch])
        for i, (row, tokens) in enumerate(group):
            end = offset + len(tokens)
            for layer, c in enumerate(row.cache):
                c.state = (batch[layer].keys[i : i + 1, :, :end, :], batch[layer].values[i : i + 1, :, :end, :], end)
            row.fed = end

    # ---- sampling ------------------------------------------------------------
    def _sample(
        self, rids: list[int], inputs: list[list[int]], logits: mx.array, step_tokens: list[mx.array]
    ) -> tuple[list[int], list[int] | None, Any]:
        """Sample each row's tokens. A pure decode group gives one ``[B]`` array
        (also appended to ``step_tokens``); otherwise a list of per-row arrays."""
        samplers = [self._rows[rid].sampler for rid in rids]
        if logits.shape[1] == 1 and all(len(x) == 1 for x in inputs):
            toks = self._sample_last(logits, samplers)
            step_tokens.append(toks)
            return list(rids), None, toks
        per_row = []
        widths = [len(x) for x in inputs]
        for i, (s, n) in enumerate(zip(samplers, widths)):
            if n == 0:
                per_row.append(mx.zeros((0,), mx.uint32))
                continue
            lp = logits[i, :n, :]
            per_row.append(s(lp - mx.logsumexp(lp, axis=-1, keepdims=True)))
        return list(rids), widths, per_row

    @staticmethod
    def _sample_last(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
        lp = logits[:, -1, :]
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        if all(s.greedy for s in samplers):
            return mx.argmax(lp, axis=-1)
        return mx.concatenate([s(lp[i : i + 1]) for i, s in enumerate(samplers)])

    def _collect(
        self, rids: list[int], widths: list[int] | None, toks: Any, verify_rids: set[int], res: StepResult
    ) -> None:
        if widths is None:
            for rid, t in zip(rids, toks.tolist()):
                res.tokens[rid] = t
                self._rows[rid].emitted += 1
            return
        for rid, n, arr in zip(rids, widths, toks):
            if n == 0:
                continue
            if rid in verify_rids:
                res.verified[rid] = arr.tolist()
            else:
                res.tokens[rid] = arr.item()
                self._rows[rid].emitted += 1

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
        rows = [self._rows[rid] for rid in batch.rids]
        depth = len(self._queued) + pending
        if all(r.emitted + depth >= r.max_tokens for r in rows):
            self._due = None  # every row has all its tokens by then
            return
        keys = [(r, r.sampler.key) for r in rows if not r.sampler.greedy]
        logits = batch.decode(self.model, tokens)
        nxt = self._sample_last(logits, [r.sampler for r in rows])
        self._queued.append(_Ahead(nxt, keys))
        self._due = self._built = nxt

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
        if len(queued) != 1 or any(rid in batch and rid not in closed for rid, _ in plan.trim):
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
        _, widths, toks = self._sample(rids, inputs, logits, [])
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
            c.trim(c.offset - row.fed)  # steps run ahead are not the row's yet
        return cache

    def stats(self) -> dict[str, Any]:
        return {"rows": len(self._rows), "batch": len(self._batch), "pipeline": self.pipeline, **self.counters}
