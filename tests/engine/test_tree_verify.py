"""A draft tree verified in one forward (engine.mlx.tree_verify) against each
of its branches fed as a plain path, on random-weight mlx-lm models."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from engine.mlx.tree_verify import _PositionedRope, keep_path, tree_forward, tree_mask
from engine.speculation.suffix import DraftTree

VOCAB = 256
# root -> 5 -> 6 -> 7; root -> 8 -> 9; 5 -> 10; 9 -> 11
TREE = DraftTree(tokens=[5, 6, 7, 8, 9, 10, 11], parents=[-1, 0, 1, -1, 3, 0, 4], score=0.0, match_len=2)


def _qwen2():
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        rope_theta=1e6, tie_word_embeddings=False,
    )  # fmt: skip
    return qwen2.Model(args)


def _llama():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
    )  # fmt: skip
    return llama.Model(args)


@pytest.fixture(params=[_qwen2, _llama], ids=["qwen2", "llama"])
def model(request):
    mx.random.seed(7)
    m = request.param()
    mx.eval(m.parameters())
    return m


def _prefilled(model, prefix):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prefix]), cache=cache))
    return cache


def _branch(tree, i):
    """Node i's tokens from the root's child down to i."""
    out = []
    while i >= 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def test_every_row_is_the_targets_logits_after_its_own_branch(model):
    prefix, root = list(range(20, 60)), 3
    cache = _prefilled(model, prefix)
    rows = tree_forward(model, cache, root, TREE)[0]
    assert rows.shape == (1 + len(TREE), VOCAB)
    for i in range(-1, len(TREE)):
        window = [root, *(_branch(TREE, i) if i >= 0 else [])]
        alone = model(mx.array([window]), cache=_prefilled(model, prefix))[0, -1]
        np.testing.assert_allclose(np.array(rows[i + 1]), np.array(alone), rtol=1e-4, atol=1e-4)
        assert int(mx.argmax(rows[i + 1])) == int(mx.argmax(alone))


def test_a_path_shaped_tree_is_a_path_verify(model):
    prefix, root, drafts = list(range(30, 50)), 9, [1, 2, 3, 4]
    tree_rows = tree_forward(model, _prefilled(model, prefix), root, DraftTree.of_path(drafts))
    path_rows = model(mx.array([[root, *drafts]]), cache=_prefilled(model, prefix))
    np.testing.assert_allclose(np.array(tree_rows), np.array(path_rows), rtol=1e-5, atol=1e-5)


def test_keep_path_leaves_the_cache_a_path_verify_leaves(model):
    prefix, root = list(range(40, 70)), 4
    cache = _prefilled(model, prefix)
    start = cache[0].offset
    tree_forward(model, cache, root, TREE)
    path = [3, 4, 6]  # root -> 8 -> 9 -> 11: not the window's first nodes
    keep_path(cache, start, path)
    fed = _prefilled(model, [*prefix, root, 8, 9, 11])
    assert cache[0].offset == fed[0].offset == start + 4
    for mine, theirs in zip(cache, fed):
        k, v = mine.keys[..., : mine.offset, :], mine.values[..., : mine.offset, :]
        k2, v2 = theirs.keys[..., : theirs.offset, :], theirs.values[..., : theirs.offset, :]
        np.testing.assert_allclose(np.array(k), np.array(k2), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(v), np.array(v2), rtol=1e-4, atol=1e-4)
    # and decoding goes on as from the path's cache
    nxt = model(mx.array([[12]]), cache=cache)[0, -1]
    ref = model(mx.array([[12]]), cache=fed)[0, -1]
    np.testing.assert_allclose(np.array(nxt), np.array(ref), rtol=1e-4, atol=1e-4)


def test_keep_path_of_nothing_keeps_the_root_only(model):
    prefix = list(range(10, 30))
    cache = _prefilled(model, prefix)
    start = cache[0].offset
    tree_forward(model, cache, 2, TREE)
    keep_path(cache, start, [])
    assert cache[0].offset == start + 1
    nxt = model(mx.array([[7]]), cache=cache)[0, -1]
    ref = model(mx.array([[7]]), cache=_prefilled(model, [*prefix, 2]))[0, -1]
    np.testing.assert_allclose(np.array(nxt), np.array(ref), rtol=1e-4, atol=1e-4)


def test_the_layers_rope_is_restored_after_the_forward(model):
    ropes = [layer.self_attn.rope for layer in model.layers]
    tree_forward(model, _prefilled(model, [1, 2, 3]), 4, TREE)
    assert [layer.self_attn.rope for layer in model.layers] == ropes
    assert not any(isinstance(r, _PositionedRope) for r in ropes)


def test_positioned_rope_is_the_consecutive_rope_bit_for_bit():
    import mlx.nn as nn

    rope = nn.RoPE(16, base=1e6)
    x = mx.random.normal((1, 4, 6, 16))
    placed = _PositionedRope(rope, mx.array(list(range(37, 43))))(x)
    assert mx.array_equal(placed, rope(x, offset=37))


def test_the_mask_hides_siblings_and_shows_ancestors():
    m = np.array(tree_mask(TREE, offset=3))
    assert m.shape == (8, 11)
    assert m[:, :3].all()  # the cached prefix
    window = m[:, 3:]
    assert window[:, 0].all()  # the root
    # node 4 (token 9) follows node 3 (token 8): sees root, 3, itself; not 0, 1, 2, 5, 6
    assert window[5].tolist() == [True, False, False, False, True, True, False, False]
    # node 5 (token 10) follows node 0
    assert window[6].tolist() == [True, True, False, False, False, False, True, False]


def test_a_batched_cache_is_refused(model):
    cache = [BatchKVCache([0]) for _ in model.layers]
    with pytest.raises(TypeError, match="plain KVCache"):
        tree_forward(model, cache, 1, TREE)
    c2 = copy.copy(cache)
    with pytest.raises(TypeError):
        keep_path(c2, 0, [])
