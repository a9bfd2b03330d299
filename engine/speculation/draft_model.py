"""Draft models: a smaller model with the target's tokenizer and its own cache.

The protocol ``actors.drafter`` drives, with two implementations, one per wing
of ``engine/``:

* ``engine.mlx.draft_model.MlxDraftModel`` — an mlx-lm model loaded from its
  own directory (the bundled ``tiny-draft`` or any ``--draft-model PATH``). It
  never touches the target's weights: it is loaded from a different directory,
  and a path that resolves to the target's is refused. Every call runs on the
  engine's MLX device thread (``engine.device.ThreadDevice``), like the target's.
* ``engine.fake.draft_model.FakeDraftModel`` — the fake GPU's drafter: it
  proposes the fake target's greedy token with probability ``agree`` (decided
  by a hash of the context, so it is deterministic) and the runner-up
  otherwise. Its cache is a list of running hashes with real trim semantics,
  so rollback bugs show as wrong drafts — which cost acceptance, never
  output, exactly as on MLX.

``generate(cache, feed, k)`` feeds ``feed`` (the context tokens the cache
lacks, the last one included) and proposes ``k`` greedy tokens; afterwards
the cache holds ``feed + d1..d_{k-1}`` (``d_k`` was never fed).

Here also what names a drafter's shape and tokenizer without loading one
(``vocab_digest``, ``narrow_llama_config``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol


class DraftModel(Protocol):
    def new_cache(self) -> Any: ...

    def can_trim(self, cache: Any) -> bool: ...

    def trim(self, cache: Any, n: int) -> int: ...

    def feed(self, cache: Any, tokens: list[int]) -> None: ...

    def generate(self, cache: Any, feed: list[int], k: int) -> list[int]: ...

    def generate_many(self, items: list[tuple[Any, list[int], int]]) -> list[list[int]]:
        """``generate`` for several rows' ``(cache, feed, k)`` at once, in order
        (the MLX drafter: one graph and one evaluation for all of them)."""
        ...

    def cost_s(self, fed: int, drafted: int) -> float:
        """Virtual-time cost for the fake GPU's device; 0 for real hardware."""
        ...

    def step_costs_s(self) -> tuple[float, float]:
        """``(one draft step, one caught-up token)`` in seconds: timed on real
        hardware, the configured costs on the fake GPU (adaptive γ's prior
        before a round is measured: ``ember.spec_build``)."""
        ...


# ---------------------------------------------------------------------------


def vocab_digest(vocab: dict[str, int]) -> str:
    """sha256 of a tokenizer's vocabulary (token → id, added tokens included):
    how a drafter shipped without its own tokenizer names the one it shares."""
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def narrow_llama_config(target_cfg: dict[str, Any], hidden: int, layers: int) -> dict[str, Any]:
    """The llama shape of a narrow drafter for ``target_cfg``: its vocabulary,
    norm epsilon and RoPE base, ``hidden`` wide (64-wide heads), ``layers`` deep,
    a tied embedding (``tools/drafter_cost.py``, ``tools/train_drafter.py``)."""
    heads = max(1, hidden // 64)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 3,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": target_cfg.get("rope_theta", 100000.0),
        "vocab_size": target_cfg["vocab_size"],
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 8192),
        "tie_word_embeddings": True,
    }
