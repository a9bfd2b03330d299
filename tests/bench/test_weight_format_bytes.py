"""bench.cpu.weight_format's floor counts the bytes a decode step reads, not the file's."""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten

from bench.cpu.weight_format import _weight_bytes
from tests.engine.test_qmm_kernel import _qwen2


@pytest.mark.parametrize("tied", [True, False])
def test_an_untied_input_embedding_is_not_counted_as_read(tied):
    model = _qwen2(tied, bits=8, gs=64)  # quantized: the embedding's scales and biases count too
    total, read = _weight_bytes(model)
    embedding = sum(v.nbytes for _, v in tree_flatten(model.model.embed_tokens.parameters()))
    assert total > embedding > 0
    # tied: the embedding is the head, read whole every token; untied: one row of it
    assert read == (total if tied else total - embedding)
