"""The persistent batched KV cache of the rows that are past prefill.

Built on mlx-lm's batch caches (``BatchKVCache`` and friends): rows join with
``merge`` + ``extend``, leave with ``extract`` + ``filter``, and windows of
different lengths share one forward through right padding
(``prepare(right_padding=)`` + ``finalize()``, which rolls each row's padding
to its left, where the mask hides it). The same roll trims rows by different
amounts, the per-row rollback speculative decoding needs (mlx-lm's ``trim``
is uniform across rows).

Joining and leaving copy the whole batch cache once, so the batch is kept
across steps and only changes when a row comes or goes, never re-merged per
step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, CacheList, QuantizedKVCache

from engine.mlx.quantized_batch import BatchQuantizedKVCache


def merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Per-row layer caches → one batch cache per layer (each class's own ``merge``)."""
    out = []
    for layer in zip(*caches):
        if type(layer[0]) is QuantizedKVCache:  # mlx-lm has no batch cache for it
            out.append(BatchQuantizedKVCache.merge(list(layer)))
            continue
        if not hasattr(layer[0], "merge"):
            raise TypeError(f"{type(layer[0]).__name__} cannot be batched (no merge)")
        out.append(layer[0].merge(list(layer)))
    return out


def _no_mask(N: int, *args: Any, **kwargs: Any) -> None:
    return None


class DecodeBatch:
    def __init__(self) -> None:
        self.rids: list[int] = []
        self.cache: list[Any] = []  # one batch cache per layer
        self._index: dict[int, int] = {}
        self._aligned: bool | None = None  # no row has left padding (None: ask the cache)

    def __len__(self) -> int:
        return len(self.rids)

    def __contains__(self, rid: int) -> bool:
        return rid in self._index

    def index(self, rid: int) -> int:
        return self._index[rid]

    def _reindex(self) -> None:
        self._index = {rid: i for i, rid in enumerate(self.rids)}
        self._aligned = None

    def aligned(self) -> bool:
        """No row has left padding (one row, or rows that all hold the same
        tokens' worth): a one-token step then needs no attention mask. Asked
        of the cache once after the batch changes, not per step."""
        if self._aligned is None:
            kv = [c for c in self.cache if type(c) is BatchKVCache]
            self._aligned = bool(kv) and len(kv) == len(self.cache) and not any(kv[0].left_padding.tolist())
        return self._aligned

    def add(self, rids: list[int], cache: list[Any]) -> None:
        """Append rows given as one batch cache per layer (from ``merge_caches``)."""
        if not self.rids:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.rids.extend(rids)
        self._reindex()

    def remove(self, rids: list[int], keep: set[int]) -> dict[int, list[Any]]:
        """Take rows out; return the per-row caches of those in ``keep``."""
        gone = set(rids)
        out = {rid: [c.extract(self._index[rid]) for c in self.cache] for rid in rids if rid in keep}
        survivors = [i for i, rid in enumerate(self.rids) if rid not in gone]
        if survivors:
            for c in self.cache:
                c.filter(survivors)
        else:
            self.cache = []
        self.rids = [self.rids[i] for i in survivors]
        self._reindex()
        return out

    def trim(self, n: list[int]) -> None:
        """Drop the last ``n[i]`` tokens of row i (any mix of amounts)."""
        common = min(n)
        if common:
            for c in self.cache:
                c.trim(common)
        rest = [k - common for k in n]
        if any(rest):
            self._roll_right(rest)

    def _roll_right(self, pad: list[int]) -> None:
        self._aligned = None
        for c in self.cache:
            _roll_layer(c, pad)

    def forward(self, model: Any, inputs: list[list[int]]) -> mx.array:
        """One forward over every row, row i fed ``inputs[i]`` (possibly empty);
        returns logits ``[B, L, V]`` with row i's valid at ``[:len(inputs[i])]``."""
        width = max(len(x) for x in inputs)
        pad = [width - len(x) for x in inputs]
        x = mx.array([t + [0] * p for t, p in zip(inputs, pad)]) if any(pad) else mx.array(inputs)
        if any(pad):
            # Padding sits after each row's real tokens, so the causal mask keeps it
            # out of their attention; afterwards it is rolled into the left padding.
            # mlx-lm's rotating (and SSM) batch caches also need each row's real
            # length, so that padding neither evicts a window's valid tokens nor
            # enters a recurrent state; their ``finalize`` then does the roll.
            lengths = [len(x) for x in inputs]
            for c in self.cache:
                if type(c) is not BatchKVCache:
                    c.prepare(right_padding=pad, lengths=lengths)
        if not any(pad) and width == 1:
            return self.decode(model, x[:, 0])
        logits = model(x, cache=self.cache)
        if any(pad):
            self._aligned = None
            for c in self.cache:
                if type(c) is BatchKVCache:
                    shift_rows_right(c, pad)
                else:
                    c.finalize()
        return logits

    def decode(self, model: Any, tokens: mx.array) -> mx.array:
        """One token per row (``tokens``: ``[B]``, may be lazy); logits ``[B, 1, V]``.

        mlx-lm's ``BatchKVCache`` builds a ``(B, 1, 1, L)`` mask every step,
        all True when no row has left padding; then the step runs without one,
        as mlx-lm's own ``KVCache`` decode does (~6% of a batch-1 step here,
        ``python -m bench.forward --legs mask``)."""
        if not self.aligned():
            return model(tokens[:, None], cache=self.cache)
        for c in self.cache:
            c.make_mask = _no_mask  # an instance attribute shadows the method
        try:
            return model(tokens[:, None], cache=self.cache)
        finally:
            for c in self.cache:
                del c.make_mask


def _roll_layer(c: Any, pad: list[int]) -> None:
    """Move row i's last ``pad[i]`` positions into its left padding (a per-row trim)."""
    if type(c) is BatchKVCache:
        shift_rows_right(c, pad)
    elif type(c) is BatchRotatingKVCache:
        # its ``finalize`` rolls each row by ``offset - _lengths``; only reached
        # while the ring has not wrapped (speculation's guard), as for a plain cache
        c._lengths = c.offset - mx.array(pad)
        c.finalize()
    elif type(c) is BatchQuantizedKVCache:
        c.prepare(right_padding=pad)
        c.finalize()
    elif type(c) is CacheList:
        for sub in c.caches:
            _roll_layer(sub, pad)
    else:
        raise TypeError(f"a {type(c).__name__} cannot be trimmed per row")


def shift_rows_right(c: BatchKVCache, pad: list[int]) -> None:
    """``c.prepare(right_padding=pad); c.finalize()`` for a plain ``BatchKVCache``,
    without its cost. mlx-lm's ``finalize`` gathers the whole buffer of every
    row (``dynamic_roll``: a ``take_along_axis`` over the step-rounded
    capacity); speculation calls it on every verify step and every per-row
    rollback, where it cost more than the forward itself (B=4, ~300 tokens,
    6 layers: 6.8 ms vs 1.2 ms here, docs/bench/spec.md). This moves only the
    rows that have padding, and only their used part; what lands left of the
    new left padding is masked, as after the roll."""
    idx = c._idx
    for i, p in enumerate(pad):
        if p:
            c.keys[i : i + 1, :, p:idx, :] = c.keys[i : i + 1, :, : idx - p, :]
            c.values[i : i + 1, :, p:idx, :] = c.values[i : i + 1, :, : idx - p, :]
    shift = mx.array(pad)
    c.offset = c.offset - shift
    c.left_padding = c.left_padding + shift
