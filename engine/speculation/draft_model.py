"""Draft models: a smaller model with the target's tokenizer and its own cache.

Two implementations of one small protocol, used by ``actors.drafter``:

* ``MlxDraftModel`` — an mlx-lm model loaded from its own directory (the
  bundled ``tiny-draft`` or any ``--draft-model PATH``). It never touches the
  target's weights: it is loaded from a different directory, and a path that
  resolves to the target's is refused. Every call runs on the engine's MLX
  device thread (``engine.device.ThreadDevice``), like the target's.
* ``FakeDraftModel`` — the fake GPU's drafter: it proposes the fake target's
  greedy token with probability ``agree`` (decided by a hash of the context,
  so it is deterministic) and the runner-up otherwise. Its cache is a list of
  running hashes with real trim semantics, so rollback bugs show as wrong
  drafts — which cost acceptance, never output, exactly as on MLX.

``generate(cache, feed, k)`` feeds ``feed`` (the context tokens the cache
lacks, the last one included) and proposes ``k`` greedy tokens; afterwards
the cache holds ``feed + d1..d_{k-1}`` (``d_k`` was never fed).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Protocol

import numpy as np

from engine.fake.gpu import FakeGPUConfig
from engine.fake.logits import _advance, _initial_hash, fake_logits
from engine.fake.tokenizer import ByteTokenizer
from engine.mlx.blas import blas_threads


class DraftModel(Protocol):
    def new_cache(self) -> Any: ...

    def can_trim(self, cache: Any) -> bool: ...

    def trim(self, cache: Any, n: int) -> int: ...

    def feed(self, cache: Any, tokens: list[int]) -> None: ...

    def generate(self, cache: Any, feed: list[int], k: int) -> list[int]: ...

    def cost_s(self, fed: int, drafted: int) -> float:
        """Virtual-time cost for the fake GPU's device; 0 for real hardware."""
        ...


# ---------------------------------------------------------------------------


class FakeDraftModel:
    def __init__(
        self,
        cfg: FakeGPUConfig = FakeGPUConfig(),
        *,
        agree: float = 0.7,
        seed: int = 1,
        trimmable: bool = True,
        token_cost_s: float = 0.002,
        feed_cost_s: float = 0.00002,
    ):
        self.cfg = cfg
        self.agree = agree
        self.seed = seed
        self.trimmable = trimmable
        self.token_cost_s = token_cost_s
        self.feed_cost_s = feed_cost_s
        self._h0 = _initial_hash(cfg.seed)

    def new_cache(self) -> list[int]:
        return []

    def can_trim(self, cache: list[int]) -> bool:
        return self.trimmable

    def trim(self, cache: list[int], n: int) -> int:
        if not self.trimmable:
            raise ValueError("this draft cache cannot be trimmed")
        n = min(n, len(cache))
        del cache[len(cache) - n :]
        return n

    def feed(self, cache: list[int], tokens: list[int]) -> None:
        h = cache[-1] if cache else self._h0
        for t in tokens:
            h = _advance(h, t)
            cache.append(h)

    def _propose(self, h: int) -> int:
        logits = fake_logits(self.cfg.seed, h, ByteTokenizer.vocab_size, self.cfg.eos_bias)
        if _uniform(self.seed, h) < self.agree:
            return int(logits.argmax())  # the first of the largest: argsort's stable first
        return int(np.argsort(-logits, kind="stable")[1])

    def generate(self, cache: list[int], feed: list[int], k: int) -> list[int]:
        self.feed(cache, feed)
        out: list[int] = []
        for i in range(k):
            tok = self._propose(cache[-1])
            out.append(tok)
            if i < k - 1:
                self.feed(cache, [tok])
        return out

    def cost_s(self, fed: int, drafted: int) -> float:
        return self.token_cost_s * drafted + self.feed_cost_s * fed


def _uniform(seed: int, h: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, context hash): 53 bits of
    blake2b("draft", seed, h). ``PCG64([seed, h]).random()`` did this through
    SeedSequence, ~15 us per draft token; the label keeps it apart from the
    stream ``fake_logits`` draws for the same hash."""
    d = hashlib.blake2b(b"draft:%d:%d" % (seed, h), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 11) * (1.0 / (1 << 53))


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


def small_head_drafter(config: dict[str, Any]) -> Any:
    """A llama body over the target's whole vocabulary with its own small
    head: logits over only the ``ember_head_vocab`` tokens the target emits
    most (``head_ids`` maps them back to the target's ids). At hidden 128 a
    full 49,152-token head is 6.3M multiply-adds per token, most of the
    drafter's cost; a drafter only has to guess the target's next token, and
    the target's greedy tokens come from a few thousand ids."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import LlamaModel, ModelArgs

    class SmallHeadDrafter(nn.Module):
        def __init__(self, args: ModelArgs, head_vocab: int):
            super().__init__()
            self.args = args
            self.model_type = args.model_type
            self.model = LlamaModel(args)
            self.head = nn.Linear(args.hidden_size, head_vocab, bias=False)
            self.head_ids = mx.zeros((head_vocab,), dtype=mx.int32)

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            return self.head(self.model(inputs, cache=cache))

        def to_target_ids(self, small: Any) -> Any:
            return mx.take(self.head_ids, small)

        @property
        def layers(self) -> Any:
            return self.model.layers

    return SmallHeadDrafter(ModelArgs.from_dict(config), int(config["ember_head_vocab"]))


class MlxDraftModel:
    """An mlx-lm model used only to draft. Construct it on the device thread.

    A drafter directory may leave its tokenizer out (``smollm2-draft``: the
    target's tokenizer.json alone is 3.5 MB): drafting runs on token ids, and
    ``config.json`` then names the tokenizer it shares by ``ember_vocab_sha256``
    (``vocab_digest``), which ``ember.spec_build`` checks against the target's."""

    prefill_chunk = 512

    def __init__(self, path: str | pathlib.Path):
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self._mx = mx
        self._stream = generation_stream  # the target's stream on this thread: one queue of work
        self.path = pathlib.Path(path)
        self.vocab_sha256: str | None = None
        if (self.path / "tokenizer.json").exists() or (self.path / "tokenizer_config.json").exists():
            from mlx_lm import load

            self.model, self.tokenizer = load(str(self.path))
        else:
            config = json.loads((self.path / "config.json").read_text())
            if "ember_head_vocab" in config:
                import mlx.nn as nn

                self.model = small_head_drafter(config)
                q = config.get("quantization")
                if q:
                    nn.quantize(self.model, group_size=q["group_size"], bits=q["bits"])
                self.model.load_weights(str(self.path / "model.safetensors"))
                mx.eval(self.model.parameters())
            else:
                from mlx_lm.utils import load_model

                self.model, config = load_model(self.path)
            self.tokenizer = None
            self.vocab_sha256 = config.get("ember_vocab_sha256")
        # A small-head drafter's argmax is an index into its head: map it back.
        self._to_ids = getattr(self.model, "to_target_ids", lambda y: y)
        self.vocab_size = int(self.model.args.vocab_size) if hasattr(self.model, "args") else None

    def new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def can_trim(self, cache: list[Any]) -> bool:
        return all(c.is_trimmable() for c in cache)

    def trim(self, cache: list[Any], n: int) -> int:
        from mlx_lm.models.cache import trim_prompt_cache

        return trim_prompt_cache(cache, n) if n > 0 else 0

    def _forward(self, cache: list[Any], tokens: Any) -> Any:
        return self.model(tokens, cache=cache)

    def feed(self, cache: list[Any], tokens: list[int]) -> None:
        mx = self._mx
        with mx.stream(self._stream):
            for i in range(0, len(tokens), self.prefill_chunk):
                self._forward(cache, mx.array(tokens[i : i + self.prefill_chunk])[None])
                mx.eval([c.state for c in cache])

    def _lazy(self, cache: list[Any], feed: list[int], k: int) -> Any:
        mx = self._mx
        if len(feed) > self.prefill_chunk:
            self.feed(cache, feed[:-1])
            feed = feed[-1:]
        # The k steps are built lazily: each step's argmax feeds the next as an
        # array, so nothing waits until the caller evaluates them all at once.
        logits = self._forward(cache, mx.array(feed)[None])
        y = self._to_ids(mx.argmax(logits[:, -1, :], axis=-1))
        out = [y]
        for _ in range(k - 1):
            logits = self._forward(cache, y[:, None])
            y = self._to_ids(mx.argmax(logits[:, -1, :], axis=-1))
            out.append(y)
        return mx.concatenate(out)

    def generate(self, cache: list[Any], feed: list[int], k: int) -> list[int]:
        return self.generate_many([(cache, feed, k)])[0]

    def generate_many(self, items: list[tuple[Any, list[int], int]]) -> list[list[int]]:
        """Several rows' rounds as one graph and one evaluation (one sync per
        round for all speculating rows, not one per row)."""
        # A drafter's GEMMs are tiny (hidden ~128): splitting them over OpenBLAS
        # threads only adds sync cost (engine.mlx.blas); the target's next step sets
        # its own count again.
        blas_threads().use(1)
        with self._mx.stream(self._stream):
            outs = [self._lazy(cache, feed, k) for cache, feed, k in items]
            self._mx.eval(outs)
        return [o.tolist() for o in outs]

    def cost_s(self, fed: int, drafted: int) -> float:
        return 0.0
