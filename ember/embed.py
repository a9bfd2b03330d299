"""An embedding model served beside the chat engines: one encoder
(``engine.mlx.embed``) behind a small batcher that gathers the inputs of
concurrent requests for ``gather_s`` and runs them as one forward (at most
``max_batch`` inputs, sorted by length so padding stays small), one forward
at a time on a worker thread.

    async with EmbeddingEngine.open("all-minilm-l6-v2") as emb:
        vectors = await emb.aembed([emb.tokenize("hello")])
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from engine.errors import EngineDraining, InvalidRequest


@dataclass
class _Job:
    inputs: list[list[int]]
    done: anyio.Event = field(default_factory=anyio.Event)
    out: np.ndarray | None = None
    error: BaseException | None = None


class EmbeddingEngine:
    """What the registry holds for an embedding model (kind ``embed``)."""

    kind = "embed"

    def __init__(self, encoder: Any, model_id: str, *, gather_s: float = 0.003, max_batch: int = 64):
        self.encoder = encoder
        self.model_id = model_id
        self.gather_s = gather_s
        self.max_batch = max_batch
        self.context_length = encoder.max_seq_length
        self.vocab_size = encoder.cfg.vocab_size
        self.dim = encoder.dim
        self.truncatable = encoder.truncatable
        self.ready = False
        self._send: Any = None
        self._in_flight = 0
        self.counts = {"requests": 0, "inputs": 0, "tokens": 0, "batches": 0, "max_batch_seen": 0}

    @classmethod
    @asynccontextmanager
    async def open(cls, name_or_path: str, **kw: Any) -> AsyncIterator[EmbeddingEngine]:
        from engine.mlx.embed import load_encoder

        encoder = await anyio.to_thread.run_sync(load_encoder, name_or_path)
        engine = cls(encoder, name_or_path, **kw)
        send, receive = anyio.create_memory_object_stream[_Job](1024)
        engine._send = send
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine._batcher, receive)
            engine.ready = True
            try:
                yield engine
            finally:
                engine.ready = False
                with anyio.CancelScope(shield=True):
                    while engine._in_flight:  # an unload waits for the running requests
                        await anyio.sleep(0.005)
                await send.aclose()
        encoder.release()  # the unload frees the weights now, not when a cycle is collected

    @property
    def status(self) -> str:
        return "ready" if self.ready else "draining"

    def in_flight(self) -> int:
        """Requests running now (ember.served.Served)."""
        return self._in_flight

    async def drain(self) -> bool:
        """Admit nothing new and let the running requests finish (ember.served.Served);
        there is nothing to flush."""
        self.ready = False
        while self._in_flight:
            await anyio.sleep(0.005)
        return True

    def tokenize(self, text: str) -> list[int]:
        return self.encoder.tokenize(text)

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        return self.encoder.tokenize_many(texts)

    def check_tokens(self, ids: list[int], param: str) -> list[int]:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})", param)
        return ids[: self.context_length]  # the tokenizer's truncation, for token arrays

    async def aembed(self, inputs: list[list[int]]) -> np.ndarray:
        """Each input's embedding, (len(inputs), dim), batched with whatever else is waiting."""
        if not self.ready:
            raise EngineDraining(f"the embedding model {self.model_id!r} is unloading")
        job = _Job(inputs)
        self._in_flight += 1
        try:
            await self._send.send(job)
            await job.done.wait()
        finally:
            self._in_flight -= 1
        if job.error is not None:
            raise job.error
        assert job.out is not None
        self.counts["requests"] += 1
        self.counts["inputs"] += len(inputs)
        self.counts["tokens"] += sum(len(i) for i in inputs)
        return job.out

    async def _batcher(self, receive: Any) -> None:
        async with receive:
            async for first in receive:
                jobs = [first]
                n = len(first.inputs)
                with anyio.move_on_after(self.gather_s):
                    while n < self.max_batch:
                        job = await receive.receive()
                        jobs.append(job)
                        n += len(job.inputs)
                await self._run(jobs)

    async def _run(self, jobs: list[_Job]) -> None:
        flat = [(j, i, ids) for j, job in enumerate(jobs) for i, ids in enumerate(job.inputs)]
        flat.sort(key=lambda x: len(x[2]))
        outs = [np.zeros((len(job.inputs), self.dim), np.float32) for job in jobs]
        try:
            for s in range(0, len(flat), self.max_batch):
                chunk = flat[s : s + self.max_batch]
                vecs = await anyio.to_thread.run_sync(self.encoder.embed, [ids for _, _, ids in chunk])
                for (j, i, _), v in zip(chunk, vecs, strict=True):
                    outs[j][i] = v
                self.counts["batches"] += 1
                self.counts["max_batch_seen"] = max(self.counts["max_batch_seen"], len(chunk))
        except Exception as exc:  # noqa: BLE001 - handed to every waiter of this batch
            for job in jobs:
                job.error = exc
        for job, out in zip(jobs, outs, strict=True):
            job.out = out
            job.done.set()

    def memory(self) -> dict[str, int]:
        return {"weights_bytes": int(self.encoder.weight_bytes), "kv_bytes": 0, "ram_tier_bytes": 0}

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "kind": "embed",
            "ready": self.ready,
            "dim": self.dim,
            "max_seq_length": self.context_length,
            "embeddings": dict(self.counts),
        }


def truncate_dims(vecs: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """``dimensions``: the first N components, renormalised (Matryoshka models)."""
    if dimensions is None or dimensions >= vecs.shape[1]:
        return vecs
    out = vecs[:, :dimensions]
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out
