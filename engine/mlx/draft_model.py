"""The MLX drafter (``engine.speculation.draft_model.DraftModel``): an mlx-lm
model loaded from its own directory (the bundled ``tiny-draft`` or any
``--draft-model PATH``), or a llama body with a small head over the tokens the
target emits most (``small_head_drafter``). Every call runs on the engine's
MLX device thread, like the target's."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from engine.mlx.blas import blas_threads


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

    def __init__(self, path: str | pathlib.Path, qmm_kernel: bool = True):
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
        if qmm_kernel and mx.default_device() == mx.cpu:
            from engine.mlx import qmm_linear

            qmm_linear.install(
                self.model
            )  # a quantized drafter's layers as the target's (its prefill and dot settings)
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

    def greedy_next(self, tokens: list[int]) -> list[int]:
        """Its argmax after each prefix of ``tokens`` (one forward, a throwaway cache)."""
        mx = self._mx
        with mx.stream(self._stream):
            logits = self._forward(self.new_cache(), mx.array(tokens)[None])
            out: list[int] = self._to_ids(mx.argmax(logits[0], axis=-1)).tolist()
            return out

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

    def step_costs_s(self, context: int = 16, catch_up: int = 64, tries: int = 3) -> tuple[float, float]:
        """``(one draft step, one caught-up token)`` in seconds, timed on a
        throwaway cache (the fastest of ``tries``): a one-token ``generate``
        after a ``context``-token feed, and a ``catch_up``-token feed per token."""
        import time

        step = feed = float("inf")
        for _ in range(tries):
            cache = self.new_cache()
            t0 = time.perf_counter()
            self.feed(cache, [0] * catch_up)
            feed = min(feed, (time.perf_counter() - t0) / catch_up)
            t0 = time.perf_counter()
            self.generate(cache, [0], 1)
            step = min(step, time.perf_counter() - t0)
        return step, feed
