"""Verify a draft tree in one forward: a tree attention mask and per-node positions.

A path verify feeds the last emitted token and the drafts as one window; the
causal mask and consecutive positions make each logit row the target's
prediction after that prefix. A tree (``engine.speculation.suffix.DraftTree``)
puts siblings — other continuations of the same prefix — in the same window,
so two things change (SpecInfer, Medusa, SuffixDecoding's tree verify):

* **the mask**: node i sees the cached prefix, the root and its own ancestors
  only, never a sibling's branch;
* **the positions**: node i sits at ``offset + depth(i)``, not at
  ``offset + i``. mlx-lm's attention ropes a window at consecutive positions
  from ``cache.offset``, so for the forward each layer's ``rope`` is wrapped
  to rope every window row at its own position (``mx.fast.rope`` with one
  offset per row: the same bits as the consecutive call,
  tests/engine/test_tree_verify.py).

Afterwards the cache holds K/V for every node; ``keep_path`` moves the
accepted nodes' K/V to the positions right after the root, where a path's
would have been written, and drops the rest. Plain ``KVCache`` layers at
batch 1 (the measurement in ``bench.spec.tree``); a batched or quantized
cache raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from engine.speculation.suffix import DraftTree


class _PositionedRope(nn.Module):
    """A layer's rope, applied at given positions instead of consecutive ones."""

    def __init__(self, rope: Any, positions: mx.array):
        super().__init__()
        self.inner = rope
        self.positions = positions  # one per window row

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        B, H, L, D = x.shape
        if B != 1 or self.positions.shape[0] != L:
            raise ValueError(f"a tree window of {self.positions.shape[0]} rows at batch 1, got {x.shape}")
        # (1, H, L, D) -> (L, H, 1, D): every row its own sequence of one, at its own offset
        out = self.inner(x.transpose(2, 1, 0, 3), offset=self.positions)
        return out.transpose(2, 1, 0, 3)


def _rope_owners(model: Any) -> list[Any]:
    """The modules that rope (mlx-lm's attention modules keep theirs as ``rope``)."""
    return [m for _, m in model.named_modules() if isinstance(getattr(m, "rope", None), nn.Module)]


def tree_mask(tree: DraftTree, offset: int) -> mx.array:
    """``(1 + n, offset + 1 + n)`` booleans: every row sees the cached prefix;
    window row 0 is the root, row i + 1 node i, which sees the root, its
    ancestors and itself."""
    n = len(tree)
    rows: list[list[bool]] = [[True] + [False] * n]
    for i, p in enumerate(tree.parents):
        row = list(rows[p + 1]) if p >= 0 else [True] + [False] * n
        row[i + 1] = True
        rows.append(row)
    window = mx.array(rows)
    return mx.concatenate([mx.ones((n + 1, offset), dtype=mx.bool_), window], axis=1)


@contextlib.contextmanager
def _tree_window(model: Any, cache: list[Any], tree: DraftTree) -> Iterator[None]:
    offset = cache[0].offset
    positions = mx.array([offset] + [offset + d for d in tree.depths()])
    mask = tree_mask(tree, offset)
    owners = _rope_owners(model)
    if not owners:
        raise TypeError(f"{type(model).__name__}: no attention module with a rope to place tree nodes")
    ropes = [m.rope for m in owners]
    for m, r in zip(owners, ropes):
        m.rope = _PositionedRope(r, positions)
    for c in cache:
        c.make_mask = lambda *a, **k: mask  # an instance attribute shadows the method
    try:
        yield
    finally:
        for m, r in zip(owners, ropes):
            m.rope = r
        for c in cache:
            del c.make_mask


def tree_forward(model: Any, cache: list[Any], root: int, tree: DraftTree) -> mx.array:
    """Logits ``(1, 1 + n, V)``: row 0 the target's prediction after ``root``
    (the last emitted token, not yet in the cache), row i + 1 after node i's
    branch. Every node's K/V is left in the cache (``keep_path`` next)."""
    _check(cache)
    x = mx.array([[root, *tree.tokens]])
    with _tree_window(model, cache, tree):
        return model(x, cache=cache)


def keep_path(cache: list[Any], start: int, path: list[int]) -> None:
    """After ``tree_forward`` from cache offset ``start``: keep the root's
    and the accepted nodes' K/V (``path``: node indices, root to leaf) at
    ``start``, ``start + 1``, …, as a path verify leaves them; drop the rest."""
    _check(cache)
    rows = [start] + [start + 1 + i for i in path]
    keep = len(rows)
    if rows != list(range(start, start + keep)):  # a path along the window's first nodes is already in place
        idx = mx.array(rows)
        for c in cache:
            c.keys[..., start : start + keep, :] = c.keys[..., idx, :]
            c.values[..., start : start + keep, :] = c.values[..., idx, :]
    for c in cache:
        c.offset = start + keep


def _check(cache: list[Any]) -> None:
    for c in cache:
        if type(c) is not KVCache:
            raise TypeError(f"tree verify needs plain KVCache layers at batch 1, got {type(c).__name__}")
