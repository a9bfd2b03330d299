"""Engine configuration: one frozen struct, validated once at startup."""

from __future__ import annotations

import msgspec

from engine.adapters import AdapterSpec

SSD_AUTO = "auto"  # EngineConfig.ssd_cache_dir: the default folder and cap (ember.ssd_tier)


# The fake GPU's settings (engine.fake.gpu), here beside the rest of the engine's:
# a config names its backend's knobs without importing the backend.
class FakeGPUConfig(msgspec.Struct, frozen=True, kw_only=True):
    seed: int = 0
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 4
    context_length: int = 32_768
    eos_bias: float = 0.0  # added to the EOS logit; >0 makes EOS appear
    # cost model, seconds
    prefill_a: float = 0.004
    prefill_b: float = 0.00005
    decode_c: float = 0.010
    decode_d: float = 0.0005
    verify_b: float = 0.0006
    # the fake drafter (``draft_model="fake-draft"``): a draft step per token, a caught-up context token
    draft_token_s: float = 0.002
    draft_feed_s: float = 0.00002
    # faults
    fault_seed: int = 0
    slow_step_prob: float = 0.0
    slow_step_factor: float = 20.0
    hang_step_prob: float = 0.0
    oom_step_prob: float = 0.0


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # backend: "fake" (deterministic fake GPU), "mlx" (mlx-lm models) or
    # "scripted" (the fake GPU answering from a script file: engine.fake.scripted)
    backend: str = "mlx"
    model: str = "tiny"  # bundled name or an mlx-lm model directory (scripted: the script file)
    fake: FakeGPUConfig = FakeGPUConfig()
    # batching
    max_batch: int = 8
    max_queue: int = 64
    prefill_chunk: int = 512
    # while rows decode, a step's prefill takes at most this share of a decode
    # step's time, so a long prompt arriving does not stall the running streams
    # (actors/prefill_budget.py); None: the full chunk every step. `ember serve`
    # sets 0.5 (--prefill-share); the embedded Engine keeps the full chunk
    prefill_share: float | None = None
    # rows prefilling in the same step share one forward (MLX); False: each
    # row alone, bit for bit mlx_lm's own prefill on the same weights (batched is
    # ~1e-6 off in fp32)
    batch_prefill: bool = True
    # on MLX's CPU backend, store Linear weights as W.T once at load: OpenBLAS's
    # few-row GEMM (decode, verify windows) is faster on that layout
    # (engine.mlx.cpu_layout); logits ~1e-5 from mlx-lm's layout. No effect on GPUs.
    cpu_pretranspose: bool = True
    # on MLX's CPU backend, one attention call runs in this many parts on
    # streams (cores) of their own, bit for bit the whole call
    # (engine.mlx.split_attention); None: one per core, at most 4; 1: off
    attention_streams: int | None = None
    # on MLX's CPU backend, long attention calls take their softmax in a C
    # kernel built at first use (engine.mlx.softmax_kernel: MLX's softmax bit
    # for bit, vectorized, on attention_streams threads); False: MLX's own
    softmax_kernel: bool = True
    # on MLX's CPU backend, quantized layers (mlx-lm's QuantizedLinear, a tied
    # QuantizedEmbedding head) take a C kernel built at first use
    # (engine.mlx.qmm_kernel: MLX's quantized_matmul bit for bit, vectorized,
    # on all cores); False: MLX's own (one core, scalar)
    qmm_kernel: bool = True
    # with qmm_kernel, prefill-sized calls (engine.mlx.qmm_linear.PREFILL_ROWS
    # rows or more) dequantize the weight (bit for bit mx.dequantize) and run
    # a float32 GEMM: several times faster at 512 rows, logits ~1e-5 from
    # MLX's quantized_matmul (BLAS's order of sums); decode stays bit exact.
    # False (or EMBER_QMM_PREFILL=0): the exact kernel for every call
    qmm_prefill: bool = True
    # with qmm_kernel, calls of 8-bit layers (decode and prefill) take the kernel's
    # integer dot path where the CPU has AVX-512 VNNI (x rounded to int16 a group:
    # ~1e-5 error a product, not mlx-lm's bits; its quality against float32 is
    # in docs/bench/weight-format.md, q8dot). False (or EMBER_QMM_DOT=0): the
    # exact kernel, greedy tokens mlx-lm's
    qmm_dot: bool = True
    # on MLX's CPU backend, float32 layers' few-row matmuls (decode, short
    # verify windows: engine.mlx.fmm_linear.MAX_ROWS rows or fewer) take a C
    # kernel built at first use as an MLX primitive (engine.mlx.mlx_ops):
    # ~1.5-2x OpenBLAS's GEMM at those shapes; sums in another order than
    # OpenBLAS's (~1e-7 relative). False (or EMBER_FMM=0): MLX's matmul
    fmm_kernel: bool = True
    # KV cache options as mlx-lm has them (docs/compat-matrix.md): a sliding
    # window of this many tokens for models without their own cache layout
    # (mlx-lm's --max-kv-size, without attention sinks), and KV quantized to
    # this many bits (mlx-lm's --kv-bits, group size --kv-group-size), both
    # with batching, speculation and the prompt-cache tiers
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    step_timeout_s: float | None = None
    # tiered prompt cache
    prompt_cache_gib: float = 2.0  # RAM tier cap; 0 disables
    # None: no SSD tier; "auto" (SSD_AUTO): one folder per model under the
    # cache root, cap lowered to a tenth of free space; a path: that folder.
    # Decided once, by ember.ssd_tier.resolve_ssd (serve, launch, Engine.open)
    ssd_cache_dir: str | None = None
    ssd_cache_max_gib: float = 32.0
    ssd_cache_verify: bool = True  # per-tensor xxh3 on every restore (docs/cold-tier.md: its measured cost)
    ssd_demote_idle_s: float | None = None  # None: ember.ssd_tier.DEMOTE_IDLE_S
    # a cached prefix shorter than this is not reused (RAM or SSD): it would save
    # a few tokens of prefill and cost a cache copy or a disk read, and keep the
    # row out of a batched prefill (rows prefill together from the same offset)
    min_cached_prefix: int = 16
    # a request whose prompt shares at least this many uncached tokens with a
    # row prefilling now waits for that row's checkpoint of them instead of
    # prefilling them too (subagents on one cold system prompt: one prefill,
    # not N; actors/scheduler_core.py, "shared prefill"); 0: off
    shared_prefill_min: int = 256
    # durability
    writebehind: bool = True
    writebehind_debounce_s: float = 1.0
    writebehind_busy_retry_s: float = 5.0
    spill_queue_gib: float = 2.0
    shutdown_timeout_s: float = 120.0
    # speculative decoding
    draft_model: str | None = None  # path, "tiny-draft" or "ngram"
    num_draft_tokens: int | None = None  # None: adaptive
    # one model across ranks launched by mlx.launch: "tensor" or "pipeline"
    # (engine.mlx.distributed; the RAM tier in lock-step, the SSD tier per rank: actors.distributed_tier)
    distributed: str | None = None
    # LoRA adapters served beside the base model (--adapter NAME=PATH; engine.adapters)
    adapters: tuple[AdapterSpec, ...] = ()
    # misc
    seed: int = 0
    model_name: str | None = None  # the name served in /v1/models

    def validate(self) -> EngineConfig:
        from engine.errors import InvalidRequest

        if self.backend not in ("fake", "mlx", "scripted"):
            raise InvalidRequest(f"unknown backend {self.backend!r} (fake, mlx or scripted)", "backend")
        if self.max_batch < 1:
            raise InvalidRequest("max_batch must be >= 1", "max_batch")
        if self.max_queue < 0:
            raise InvalidRequest("max_queue must be >= 0", "max_queue")
        if self.prefill_chunk < 1:
            raise InvalidRequest("prefill_chunk must be >= 1", "prefill_chunk")
        if self.prefill_share is not None and not self.prefill_share > 0:
            raise InvalidRequest("prefill_share must be > 0 (or None: the full chunk)", "prefill_share")
        if self.attention_streams is not None and self.attention_streams < 1:
            raise InvalidRequest("attention_streams must be >= 1 (1: no split)", "attention_streams")
        if self.min_cached_prefix < 1:
            raise InvalidRequest("min_cached_prefix must be >= 1", "min_cached_prefix")
        if self.shared_prefill_min < 0:
            raise InvalidRequest("shared_prefill_min must be >= 0 (0: off)", "shared_prefill_min")
        if self.max_kv_size is not None and self.max_kv_size < 1:
            raise InvalidRequest("max_kv_size must be >= 1", "max_kv_size")
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise InvalidRequest("kv_bits must be one of 2, 3, 4, 5, 6, 8", "kv_bits")
        if self.kv_group_size not in (32, 64, 128):
            raise InvalidRequest("kv_group_size must be 32, 64 or 128", "kv_group_size")
        if self.prompt_cache_gib < 0:
            raise InvalidRequest("prompt_cache_gib must be >= 0", "prompt_cache_gib")
        if self.ssd_cache_dir and self.ssd_cache_dir != SSD_AUTO and self.prompt_cache_gib == 0:
            raise InvalidRequest(
                "the SSD cache needs the RAM tier: --prompt-cache 0 with --ssd-cache", "prompt_cache_gib"
            )
        if self.distributed is not None:
            self._check_distributed()
        if self.adapters:
            self._check_adapters()
        return self

    def _check_adapters(self) -> None:
        from engine.errors import InvalidRequest

        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"adapter names must differ, got {names}", "adapters")
        if self.backend != "mlx":
            raise InvalidRequest("LoRA adapters need the MLX backend, not the fake GPU", "adapters")
        if self.distributed is not None:
            raise InvalidRequest("LoRA adapters are not served across ranks (--distributed)", "adapters")

    def _check_distributed(self) -> None:
        from engine.errors import InvalidRequest

        if self.distributed not in ("tensor", "pipeline"):
            raise InvalidRequest(f"unknown distributed mode {self.distributed!r} (tensor or pipeline)", "distributed")
        if self.backend != "mlx":
            raise InvalidRequest("distributed serving needs the MLX backend, not the fake GPU", "distributed")
