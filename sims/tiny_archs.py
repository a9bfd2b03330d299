"""Tiny random-weight instances of mlx-lm architectures, saved as model dirs.

Each is built with mlx-lm's own model class (``mlx_lm.models.<arch>.Model``)
and saved as an mlx-lm model directory (config.json + safetensors + the
bundled tiny tokenizer), so ``ember``/``Engine`` and ``mlx_lm.load`` load it
like any checkpoint. A few hundred thousand parameters in fp32: seconds to
build, and greedy decoding that is exact between batched and lone forwards.
They cover every cache kind mlx-lm makes: plain ``KVCache`` (llama, qwen3,
the MoE), ``RotatingKVCache`` next to ``KVCache`` (gemma3_text, a window
shorter than the test prompts), ``ArraysCache`` next to ``KVCache`` (lfm2,
qwen3_next), ``ArraysCache`` alone (mamba2) and ``CacheList`` (falcon_h1).

    python -m sims.tiny_archs OUT_DIR [ARCH ...]   # writes OUT_DIR/<arch>
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
from typing import Any

VOCAB = 2048  # the bundled tiny tokenizer's
_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 4096, "torch_dtype": "float32"}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        # sliding_window_pattern 2: layer 0 slides over 24 tokens, layer 1 attends to all
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 24,
        "sliding_window_pattern": 2,
        "rms_norm_eps": 1e-6,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "norm_topk_prob": True,
    },
    "lfm2": {
        "model_type": "lfm2",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1],
        "rope_theta": 10000.0,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "head_dim": 16,
        "full_attention_interval": 2,
    },
    "mamba2": {
        "model_type": "mamba2",
        "num_heads": 4,
        "head_dim": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 100.0],
        "time_step_rank": 4,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "mlp_multipliers": [1.0, 1.0],
        "ssm_multipliers": [1.0, 1.0, 1.0, 1.0, 1.0],
        "rope_theta": 10000.0,
    },
}


def tokenizer_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent.parent / "engine" / "models" / "tiny"


def build(arch: str, out: pathlib.Path, *, seed: int = 0, bits: int | None = None, **overrides: Any) -> pathlib.Path:
    """Write a random-weight ``arch`` model dir at ``out`` (4-bit weights when ``bits``)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    config = {**_COMMON, **CONFIGS[arch], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # mlx's default inits leave some models' logits nearly flat (every greedy
    # step a knife-edge tie); wider weights make the argmax decisive
    params = [(k, v * 4 if v.ndim >= 2 and "embed" not in k else v) for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    if bits:
        model, config = quantize_model(model, config, 32, bits)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = tokenizer_dir() / name
        if src.is_file():
            shutil.copy(src, out / name)
    return out


def main(argv: list[str]) -> None:
    out = pathlib.Path(argv[0])
    for arch in argv[1:] or list(CONFIGS):
        print(build(arch, out / arch))


if __name__ == "__main__":
    main(sys.argv[1:])
