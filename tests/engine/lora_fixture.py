"""A random LoRA adapter for the tiny model in mlx-lm's format (tests only)."""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx
from mlx.utils import tree_flatten

KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def make_adapter(model_path: pathlib.Path, out: pathlib.Path, *, seed: int, num_layers: int = 4) -> pathlib.Path:
    """mlx-lm's own LoRA layers on a fresh load of the model, B drawn non-zero
    (a trained adapter's; mlx-lm starts B at zero, which would change nothing),
    saved as ``mlx_lm.lora`` saves them: the trainable parameters."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_path))
    model.freeze()
    params = {"rank": 4, "scale": 8.0, "dropout": 0.0, "keys": KEYS}
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    for _, m in model.named_modules():
        if type(m).__name__ == "LoRALinear":
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
