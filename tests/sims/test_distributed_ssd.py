"""The SSD tier of a distributed engine (actors/distributed_tier.py): each rank
persists its own shard under ``DIR/rank{r}of{n}/``; the tier round-trips across
a restart of both ranks, and one rank's bad file is a miss on every rank.

Oracle: mlx-lm's ``stream_generate`` in one process, greedy, never persisted.
Two ranks of the ring backend on localhost (tests/sims/test_distributed.py starts
them as ``mlx.launch`` would): the bundled llama split by tensor (rank 1's file
corrupted), the tiny random qwen2 split by pipeline stage (rank 1's file
deleted). Two launches each, about 30 s each on the shared 2-core machine.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sims.test_distributed import Ranks, qwen2_dir, reference  # noqa: F401 - qwen2_dir: a fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
]  # two mx.distributed ranks per case, restarted: ~1 min a case without OpenBLAS

N = 16
# three long prompts (hundreds of tokens) with nothing in common at their start
PROMPT_A = "def fib(n):\n    " + "".join(f"# step {i}: add the two previous numbers\n    " for i in range(40))
PROMPT_B = "The weather report for the coast. " + " ".join(f"Station {i} reports light wind." for i in range(40))
PROMPT_C = "Dear committee,\n" + " ".join(f"Item {i} of the agenda was postponed." for i in range(40))


def ask(url: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": N, "ignore_eos": True}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict[str, Any]) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def flush(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/admin/cache/flush", json={}, timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["durable"] is True, r.json()
    return r.json()


def files(root: Path, rank: int) -> set[Path]:
    return set((root / f"rank{rank}of2").rglob("*.kv"))


def stamps(paths: set[Path]) -> dict[str, tuple[int, int]]:
    """Each file's identity: a file deleted and written again has a new one."""
    return {p.name: (st.st_ino, st.st_mtime_ns) for p in paths if p.exists() for st in [p.stat()]}


def untouched(root: Path, rank: int, before: dict[str, tuple[int, int]]) -> set[str]:
    """The files of ``before`` that this rank still holds as they were."""
    now = stamps(files(root, rank))
    return {name for name, st in before.items() if now.get(name) == st}


def stop_both(ranks: Ranks) -> None:
    ranks.procs[0].send_signal(signal.SIGTERM)  # rank 0 drains and tells the follower to stop
    assert ranks.procs[0].wait(timeout=60) == 0, ranks.logs()
    assert ranks.procs[1].wait(timeout=30) == 0, ranks.logs()


def ssd(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=10).json()["ssd_cache"]


@pytest.fixture(scope="module")
def tiny() -> str:
    from engine.models import resolve_model

    return str(resolve_model("tiny"))


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory, tiny) -> str:
    """The bundled llama with every other layer a 32-token sliding window
    (mlx-lm's ``RotatingKVCache``): its caches cannot be trimmed back, so the
    prompt's end is kept as a checkpoint entry (actors/scheduler.py), which
    the ranks must name alike (engine.mlx.distributed.checkpoint_names)."""
    out = tmp_path_factory.mktemp("sliding") / "model"
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    config["sliding_window"] = 32
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    "model_fixture, mode, fault",
    [("tiny", "tensor", "corrupt"), ("qwen2_dir", "pipeline", "delete"), ("sliding_dir", "tensor", "corrupt")],
)
def test_tier_round_trips_across_a_restart_of_both_ranks(tmp_path, request, model_fixture, mode, fault):
    """tensor: the bundled llama, each rank its KV heads; pipeline: the tiny
    random qwen2 of tests/sims/test_distributed.py, each rank its layers; and the
    sliding-window llama, whose entries are checkpoints."""
    model = request.getfixturevalue(model_fixture)
    want_a, want_b, want_c = reference(model, [PROMPT_A, PROMPT_B, PROMPT_C], N)
    root = tmp_path / "ssd"
    flags = ["--ssd-cache", str(root)]
    run1, run2 = tmp_path / "run1", tmp_path / "run2"  # each launch's hostfile and logs
    run1.mkdir()
    run2.mkdir()

    # 1. serve both prompts, each followed by a flush: durable only when both ranks' files are
    with Ranks(run1, model, mode, extra=flags) as ranks:
        assert ask(ranks.url, PROMPT_A)["choices"][0]["text"] == want_a
        again = ask(ranks.url, PROMPT_A)  # from the RAM tier of every rank
        assert cached(again) > 0 and again["choices"][0]["text"] == want_a, again
        flush(ranks.url)
        a0, a1 = files(root, 0), files(root, 1)
        assert a0 and a1, (a0, a1)  # every rank wrote its shard
        assert ask(ranks.url, PROMPT_B)["choices"][0]["text"] == want_b
        flush(ranks.url)
        b0, b1 = files(root, 0) - a0, files(root, 1) - a1
        # the same entries, one shard per rank: B's cache, and for the sliding
        # model also B's checkpoint (its cache cannot be trimmed back to the prompt)
        assert b0 and {p.name for p in b0} == {p.name for p in b1}, (b0, b1)
        assert ask(ranks.url, PROMPT_C)["choices"][0]["text"] == want_c
        flush(ranks.url)
        c0, c1 = files(root, 0) - a0 - b0, files(root, 1) - a1 - b1
        stats = ssd(ranks.url)
        assert stats["shard_write_failures"] == 0 and stats["spills"] >= 3, stats
        stop_both(ranks)

    # 2. rank 1's files of B and rank 0's of C go bad (a flipped byte in a tensor, or gone):
    # B and C must be misses on both ranks
    for bad in (*b1, *c0):
        if fault == "corrupt":
            raw = bytearray(bad.read_bytes())
            raw[-100] ^= 0xFF
            bad.write_bytes(bytes(raw))
        else:
            bad.unlink()
    # what each rank holds of B and C now: a file the restart deletes and the
    # recomputed entry writes again reads as touched (its name alone would not)
    was_b0, was_b1 = stamps(b0), stamps(b1)
    was_c0, was_c1 = stamps(c0), stamps(c1)

    # 3. restart both: A comes back from SSD on every rank, B is computed again; both equal mlx-lm
    with Ranks(run2, model, mode, extra=flags) as ranks:
        ra = ask(ranks.url, PROMPT_A)
        assert cached(ra) > 0, ra["usage"]
        assert ra["choices"][0]["text"] == want_a
        rb = ask(ranks.url, PROMPT_B)
        assert cached(rb) == 0, rb["usage"]
        assert rb["choices"][0]["text"] == want_b
        rc = ask(ranks.url, PROMPT_C)
        assert cached(rc) == 0, rc["usage"]
        assert rc["choices"][0]["text"] == want_c
        stats = ssd(ranks.url)
        # B: rank 0's copy was fine, rank 1's not; C: rank 0's own copy was bad
        assert (stats["restores"], stats["shard_misses"]) == (1, 1), stats
        # B and C, computed again, may be spilling to SSD as this runs: settle
        # every rank's writes first, then compare each file with what it was
        flush(ranks.url)
        if fault == "corrupt":  # a deleted file is not in rank 0's index at all: nothing to try
            assert stats["corrupt_deleted"] == 1, stats
            left0, left1 = untouched(root, 0, was_c0), untouched(root, 1, was_c1)
            assert left0 == left1 and len(left0) < len(c0), (left0, left1, c0)  # rank 1 deleted its copy too
        # every rank deleted its file of the entry B tried; the ranks still hold the same entries
        left0, left1 = untouched(root, 0, was_b0), untouched(root, 1, was_b1)
        assert left0 == left1 and len(left0) < len(b0), (left0, left1, b0)
        stop_both(ranks)
