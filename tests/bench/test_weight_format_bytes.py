"""bench.cpu.weight_format's floor counts the bytes a decode step reads, not the file's."""

from __future__ import annotations

import pytest

from bench.cpu.weight_format import _weight_bytes


def _qwen2(tied: bool):
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=1000,
        tie_word_embeddings=tied,
    )
    return qwen2.Model(args)


@pytest.mark.parametrize("tied", [True, False])
def test_an_untied_input_embedding_is_not_counted_as_read(tied):
    model = _qwen2(tied)
    total, read = _weight_bytes(model)
    embedding = model.model.embed_tokens.weight.nbytes
    assert total > embedding
    # tied: the embedding is the head, read whole every token; untied: one row of it
    assert read == (total if tied else total - embedding)
