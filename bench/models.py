"""Many models behind one server, measured (issue #30).

    python -m bench.models [--models tiny,smollm2-135m] [--embed all-minilm-l6-v2]
        [--switch smollm2-135m,tiny] [--rounds 3] [--tokens 16] [--switch-requests 12]
        [--batches 1,8,32] [--embed-rounds 5]

One ``ember serve --model tiny-draft --pin tiny-draft --keep-alive -1 --no-ssd-cache``
(a subprocess, on a free port); every model measured is loaded on demand beside it.
Three tables, Markdown on stdout (``bench.docs`` puts them in docs/bench/models.md):

1. **Load on demand.** Per model and round: ``POST /admin/models/M/unload``, then
   a request that loads it (cold) and one more while it is loaded (warm). Chat:
   TTFT of a streamed ``/v1/completions``; embeddings: latency of a one-input
   ``/v1/embeddings``. Every prompt starts with its own number, so no prompt
   cache serves any of them; the SSD tier is off, so a cold request loads
   weights and nothing else. The registry's own ``load_s`` is beside it, and
   the process' first load of each model apart (it pays one-time imports).
2. **Switching.** Triples A, B, A, one request at a time (both loaded: each its
   own engine): A's TTFT and request time right after one of its own requests
   (no switch) against right after one of B's (a switch), interleaved so both
   arms see the same load; the ratio.
3. **Embeddings per second** at each batch size: Ember's ``/v1/embeddings`` (HTTP,
   ``encoding_format: base64`` as the OpenAI SDK sends it, the MLX encoder) against sentence-transformers on the same weights, in this
   process on CPU torch, interleaved call by call (never at once, so a change of
   load hits both arms alike), with the cosine of their vectors as the check that
   both computed the same thing.

Requests run one at a time; the load average is printed. Ratios, not lone
times, are the figures to quote. sentence-transformers comes with the ``test``
extra (``pip install -e ".[bench,models,test]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serve.vs_mlx_lm import Server, free_port

DEFAULT = "tiny-draft"  # the server's --model: pinned, never measured
WORDS = (
    "river stone lantern copper meadow signal harbor orchard canvas ember thistle quarry "
    "velvet compass glacier saddle beacon prism walnut tundra"
).split()


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(n)]


async def completion_ttft(client: httpx.AsyncClient, model: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(TTFT, request time) of one streamed greedy completion, in seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0


async def embed(client: httpx.AsyncClient, model: str, texts: list[str]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    # base64, as the OpenAI SDK asks by default: the vectors' bytes, not a JSON list of floats
    body = {"model": model, "input": texts, "encoding_format": "base64"}
    r = await client.post("/v1/embeddings", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
    vecs = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    return time.perf_counter() - t0, vecs


async def request_once(client: httpx.AsyncClient, model: str, kind: str, tag: str, tokens: int) -> float:
    if kind == "embed":
        return (await embed(client, model, [f"{tag} " + sentences(1, zlib.crc32(tag.encode()))[0]]))[0]
    return (await completion_ttft(client, model, f"{tag}: a short note about rivers and stones.", tokens))[0]


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/stats")).json()


def ms(x: float) -> str:
    return f"{x * 1000:.1f}"


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


async def load_table(client: httpx.AsyncClient, models: list[tuple[str, str]], rounds: int, tokens: int) -> None:
    print("### Load on demand: the first request after an unload vs one while loaded\n")
    print(f"Load average at start: {load()}. Cold and warm: medians over {rounds} rounds.\n")
    print(
        "| model | kind | first load in the process ms | cold (loads it) ms | warm ms | cold / warm "
        "| registry `load_s` ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for model, kind in models:
        # the process' first load of a kind pays one-time imports too: shown apart, not in the median
        await client.post(f"/admin/models/{model}/unload", json={})
        first = await request_once(client, model, kind, "first", tokens)
        cold, warm, loads = [], [], []
        for r in range(rounds):
            await client.post(f"/admin/models/{model}/unload", json={})
            cold.append(await request_once(client, model, kind, f"{r}-cold", tokens))
            warm.append(await request_once(client, model, kind, f"{r}-warm", tokens))
            loads.append((await stats(client))["models"][model]["registry"]["load_s"])
        c, w = statistics.median(cold), statistics.median(warm)
        what = "TTFT" if kind == "chat" else "latency"
        print(
            f"| `{model}` | {kind} ({what}) | {ms(first)} | {ms(c)} | {ms(w)} | {c / w:.0f}x "
            f"| {ms(statistics.median(loads))} |"
        )
    print()


async def switch_table(client: httpx.AsyncClient, a: str, b: str, n: int, tokens: int) -> None:
    """A's requests right after one of A's (no switch) against right after one of B's
    (a switch), interleaved: triples A, B, A, so both arms see the same load."""
    for m in (b, a):  # both loaded and warm; A last, so the first triple's first A follows an A
        await request_once(client, m, "chat", "warmup", tokens)
    after_a: list[tuple[float, float]] = []
    after_b: list[tuple[float, float]] = []
    for i in range(n):
        after_a.append(await completion_ttft(client, a, f"{i}-a: a short note about rivers.", tokens))
        await completion_ttft(client, b, f"{i}-b: a short note about rivers.", tokens)
        after_b.append(await completion_ttft(client, a, f"{i}-ab: a short note about rivers.", tokens))
    print(f"### Switching: `{a}`'s requests right after its own vs right after `{b}`'s (both loaded)\n")
    print(
        f"Load average at end: {load()}. {n} triples `{a}`, `{b}`, `{a}`, {tokens} tokens each, one request "
        f"at a time: the first `{a}` of a triple follows an `{a}` request, the last follows a `{b}` one.\n"
    )
    print("| arm | median TTFT ms | median request ms |")
    print("|---|---|---|")
    t1, e1 = statistics.median(x[0] for x in after_a), statistics.median(x[1] for x in after_a)
    t2, e2 = statistics.median(x[0] for x in after_b), statistics.median(x[1] for x in after_b)
    print(f"| no switch (after `{a}`) | {ms(t1)} | {ms(e1)} |")
    print(f"| switched (after `{b}`) | {ms(t2)} | {ms(e2)} |")
    print(f"| switched / no switch | {t2 / t1:.2f}x | {e2 / e1:.2f}x |")
    print()


def st_model(name: str) -> tuple[Any, Any]:
    """sentence-transformers on ``name``'s weights on CPU, and the torch it runs on."""
    import torch  # the bench extra (pip install -e '.[bench]')
    from sentence_transformers import SentenceTransformer

    from engine.mlx.embed import resolve_embedding_model

    return SentenceTransformer(str(resolve_embedding_model(name)), device="cpu"), torch


async def embed_table(client: httpx.AsyncClient, name: str, batches: list[int], rounds: int) -> None:
    st, torch = st_model(name)
    threads = torch.get_num_threads()
    arms = [threads, 1] if threads > 1 else [1]  # torch's default, and one thread (see the note below)
    print(f"### Embeddings per second: Ember vs sentence-transformers on `{name}`'s weights\n")
    print(
        f"Load average at start: {load()}. sentence-transformers: torch {torch.__version__} on CPU, "
        f"{' and '.join(f'{n} thread' + 's' * (n > 1) for n in arms)}. Per batch size: two warm-up calls of "
        f"each, then {rounds} rounds, each one Ember request and one `encode` per torch arm of the same new "
        "12-word sentences, one after the other; rates from the median call time.\n"
    )
    cols = " | ".join(f"ST {n}T inputs/s | Ember / ST {n}T" for n in arms)
    print(f"| batch | Ember inputs/s | {cols} | min cosine |")
    print("|---|---|" + "---|---|" * len(arms) + "---|")
    for bsz in batches:
        for w in range(2):  # new shapes: the first calls of either build their kernels
            warm = sentences(bsz, 7 + w)
            await embed(client, name, warm)
            for n in arms:
                torch.set_num_threads(n)
                st.encode(warm, batch_size=bsz)
        t_em: list[float] = []
        t_st: dict[int, list[float]] = {n: [] for n in arms}
        cos_min = 1.0
        for r in range(rounds):
            batch = sentences(bsz, 1000 * bsz + r)
            dt, got = await embed(client, name, batch)
            t_em.append(dt)
            for n in arms:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                want = st.encode(batch, batch_size=bsz, normalize_embeddings=True)
                t_st[n].append(time.perf_counter() - t0)
            cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            cos_min = min(cos_min, float(cos.min()))
        em_rate = bsz / statistics.median(t_em)
        cells = []
        for n in arms:
            st_rate = bsz / statistics.median(t_st[n])
            cells.append(f"{st_rate:.0f} | {em_rate / st_rate:.2f}x")
        print(f"| {bsz} | {em_rate:.0f} | {' | '.join(cells)} | {cos_min:.5f} |")
    torch.set_num_threads(threads)
    print(
        "\nWhy two torch arms: on a machine whose load is above its core count, torch's worker threads wait "
        "for each other (one of them is descheduled), and its default thread count can be slower than one "
        "thread; the one-thread arm is the baseline that does not depend on that.\n"
    )


async def run(args: argparse.Namespace) -> None:
    models = [(m, "chat") for m in args.models.split(",") if m] + ([(args.embed, "embed")] if args.embed else [])
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "transport.cli", "serve", "--model", DEFAULT, "--port", str(port)]
        argv += ["--pin", DEFAULT, "--keep-alive", "-1", "--no-ssd-cache"]
        server = Server("ember", argv, port, Path(tmp) / "ember.log")
        start_s = server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                print(
                    f"One `ember serve --model {DEFAULT}` (started in {start_s:.1f} s), every model below loaded "
                    f"on demand beside it; {os.cpu_count()} CPUs.\n"
                )
                if models:
                    await load_table(client, models, args.rounds, args.tokens)
                if args.switch:
                    a, b = args.switch.split(",")
                    await switch_table(client, a, b, args.switch_requests, args.tokens)
                if args.embed and args.batches:
                    await embed_table(client, args.embed, [int(b) for b in args.batches.split(",")], args.embed_rounds)
        finally:
            rc = server.stop()
            if rc not in (0, None):
                print(f"ember serve exited {rc}: {(Path(tmp) / 'ember.log').read_text()[-2000:]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m", help="chat models to load on demand (comma-separated)")
    ap.add_argument("--embed", default="all-minilm-l6-v2", help="the embedding model ('' for none)")
    ap.add_argument("--switch", default="smollm2-135m,tiny", help="A,B for the switching table ('' for none)")
    ap.add_argument("--rounds", type=int, default=3, help="unload/cold/warm rounds per model")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per completion")
    ap.add_argument("--switch-requests", type=int, default=12, help="A, B, A triples in the switching table")
    ap.add_argument("--batches", default="1,8,32", help="embedding batch sizes ('' for none)")
    ap.add_argument("--embed-rounds", type=int, default=5, help="requests per batch size")
    args = ap.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
