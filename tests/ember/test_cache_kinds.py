"""The compatibility matrix: every cache kind mlx-lm makes, through every path.

Tiny random-weight instances of mlx-lm architectures (``sims.tiny_archs``,
built with mlx-lm's own model classes, fp32) go through the whole engine and
are compared with mlx-lm itself (``generate_step``, greedy) on the same
weights: alone and batched, the same prompt twice and an extended prompt
(cached tokens where the kind allows), SSD flush → restart, n-gram
speculation alone and batched, and a 4-bit variant. docs/compat-matrix.md
is this file as a table.
"""

from __future__ import annotations

import asyncio
import pathlib

import mlx.core as mx
import pytest

from ember import Engine, EngineConfig, SamplingParams  # noqa: E402
from sims.tiny_archs import build  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# arch -> what its cache is: "kv" (trimmable everywhere), "window" (a rotating
# layer that wraps on the test prompts), "state" (SSM/recurrent layers)
ARCHS = {
    "llama": "kv",
    "qwen3": "kv",
    "gemma3_text": "window",
    "qwen3_moe": "kv",
    "lfm2": "state",
    "qwen3_next": "state",
    "mamba2": "state",
    "falcon_h1": "state",
}

PROMPTS = [
    "for i in range(10):\n    print(i)\n" * 4,
    "def add(a, b):\n    return a + b\n" * 3,
    "import os\nimport sys\n" * 5,
]
SP = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is a real thread


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> _Models:
    return _Models(tmp_path_factory.mktemp("archs"))


class _Models:
    def __init__(self, root: pathlib.Path):
        self.root = root
        self._loaded: dict[str, tuple] = {}

    def path(self, arch: str, **kw) -> pathlib.Path:
        name = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        out = self.root / name
        if not (out / "config.json").is_file():
            build(arch, out, **kw)
        return out

    def reference(self, path: pathlib.Path, tokens: list[int], n: int) -> list[int]:
        """Greedy tokens of mlx-lm itself on the same weights."""
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        key = str(path)
        if key not in self._loaded:
            self._loaded[key] = load(key)
        model, _ = self._loaded[key]
        return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def _cfg(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_batch=4, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_parity_alone_and_batched(models, arch):
    """mlx-lm's greedy tokens alone and three rows at once, with the prompt
    cache on: closing a row keeps its cache whatever its kind (an SSM's
    ``ArraysCache`` has no ``trim``: closing one killed the engine)."""
    path = models.path(arch)
    async with Engine.open(_cfg(path)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        want = [models.reference(path, p, SP.max_tokens) for p in prompts]
        alone = await engine.acomplete(prompts[0], SP)
        assert alone.token_ids == want[0]
        batched = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert [c.token_ids for c in batched] == want
        assert engine.stats()["dead"] is None
        assert engine.stats()["prompt_cache"]["puts"] >= 1
        # the three prompts prefilled in shared forwards, whatever the cache kind
        assert engine.backend.counters["prefill_together"] >= 2, engine.backend.stats()


SPEC_CASES = [(a, {}) for a in ARCHS] + [("gemma3_text", {"sliding_window": 128})]


def _case_id(x):
    return x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items())


async def _speculate(models, path, arch, kw, draft: str) -> dict:
    cfg = _cfg(path, draft_model=draft, num_draft_tokens=3, prompt_cache_gib=0)
    async with Engine.open(cfg) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        want = [models.reference(path, p, 24) for p in prompts]
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        alone = await engine.acomplete(prompts[0], sp)
        assert alone.token_ids == want[0]
        batched = await asyncio.gather(*[engine.acomplete(p, sp) for p in prompts])
        assert [c.token_ids for c in batched] == want
        stats = engine.stats()
        assert stats["dead"] is None
        stats["drafted"] = sum(c.usage.speculation.drafted for c in [alone, *batched] if c.usage.speculation)
        return stats


@pytest.mark.parametrize("arch,kw", SPEC_CASES, ids=_case_id)
async def test_ngram_speculation_alone_and_batched(models, arch, kw):
    """n-gram speculation gives mlx-lm's greedy tokens, one row and three at
    once; where the cache cannot roll a window back, the row decodes plainly
    and /stats counts it. (Random weights seldom repeat themselves, so the
    n-gram drafter proposes little here; the draft-model test below drafts
    every round.)"""
    path = models.path(arch, **kw)
    stats = await _speculate(models, path, arch, kw, "ngram:1:4")
    if ARCHS[arch] != "kv" and not kw:
        assert stats["drafted"] == 0, stats  # every proposal fell back to a plain decode


@pytest.mark.parametrize("arch,kw", SPEC_CASES, ids=_case_id)
async def test_draft_model_speculation_alone_and_batched(models, arch, kw):
    """A draft model (another random model: nearly every draft is rejected, so
    every round verifies a window and rolls it back per row) gives mlx-lm's
    greedy tokens, batched too. A sliding window the prompts do not fill
    speculates like plain KV (``BatchRotatingKVCache.prepare`` needs the
    rows' lengths for right padding: without them it raised and killed the
    engine); kinds that cannot roll back fall back, counted."""
    path = models.path(arch, **kw)
    draft = models.path("llama", seed=1)
    stats = await _speculate(models, path, arch, kw, str(draft))
    if ARCHS[arch] == "kv" or kw:
        assert stats["drafted"] > 0, stats
    else:
        assert stats["drafted"] == 0 and stats["fallbacks"]["spec_untrimmable"] > 0, stats


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_same_prompt_again_and_the_next_turn_hit(models, arch):
    """The same prompt twice, and a prompt that extends it, are served from
    the prompt cache for every kind: caches that cannot be trimmed (a wrapped
    window, SSM state) through the checkpoint taken at the prompt's end.
    Output stays mlx-lm's."""
    path = models.path(arch)
    async with Engine.open(_cfg(path)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        first = await engine.acomplete(prompts[1], SP)
        again = await engine.acomplete(prompts[1], SP)
        want = models.reference(path, prompts[1], SP.max_tokens)
        assert first.token_ids == again.token_ids == want
        assert first.usage.cached_tokens == 0
        assert again.usage.cached_tokens == len(prompts[1]) - 1, engine.stats()
        turn = prompts[1] + first.token_ids + engine.encode("import re\n")
        nxt = await engine.acomplete(turn, SP)
        assert nxt.token_ids == models.reference(path, turn, SP.max_tokens)
        # the finished row's own entry (prompt + reply) is a prefix of the next turn
        assert nxt.usage.cached_tokens == len(prompts[1]) + len(first.token_ids) - 1, engine.stats()
        if ARCHS[arch] != "kv":
            assert engine.stats()["scheduler"]["checkpoints"] >= 1


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_ssd_flush_restart_restores(models, arch, tmp_path):
    """Flush to the SSD tier, restart, and the prompt comes back from disk
    (every kind round-trips the KV file, CacheList included; kinds that
    cannot be trimmed through their prompt-end checkpoint) with mlx-lm's
    output."""
    path = models.path(arch)
    cfg = _cfg(path, ssd_cache_dir=str(tmp_path / "ssd"))
    async with Engine.open(cfg) as engine:
        prompt = engine.encode(PROMPTS[0])
        cold = await engine.acomplete(prompt, SP)
        report = await engine.aflush()
        assert report.durable, report
    async with Engine.open(cfg) as engine:
        warm = await engine.acomplete(prompt, SP)
        assert warm.token_ids == cold.token_ids == models.reference(path, prompt, SP.max_tokens)
        assert warm.usage.cached_tokens == len(prompt) - 1, engine.stats()
        assert engine.stats()["ssd_cache"]["restores"] >= 1


@pytest.mark.parametrize("arch", [*ARCHS, "llama-kv4"])
def test_every_kind_round_trips_the_kv_file(models, arch, tmp_path):
    """A cache of every kind mlx-lm makes (KVCache, RotatingKVCache wrapped,
    ArraysCache, CacheList, QuantizedKVCache) written to a KV file and read
    back continues exactly like the cache it was written from."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kv import kvfile
    from engine.kv.disk import RealDisk

    # quantized KV needs a head_dim of at least one group (32)
    path = models.path("llama", head_dim=32) if arch.endswith("kv4") else models.path(arch)
    model, tokenizer = load(str(path))
    tokens = tokenizer.encode(PROMPTS[0])
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    if arch.endswith("kv4"):
        cache = [c.to_quantized(group_size=32, bits=4) for c in cache]
    mx.eval([c.state for c in cache])
    meta = kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="tok")
    kvfile.save(RealDisk(), str(tmp_path / "e.kv"), meta, tokens, cache)
    _, back = kvfile.load(RealDisk(), str(tmp_path / "e.kv"), verify=True)
    assert [type(c) for c in back] == [type(c) for c in cache]
    x = mx.array([[tokens[-1]]])
    for _ in range(3):
        a, b = model(x, cache=cache), model(x, cache=back)
        assert mx.array_equal(a, b).item()
        x = mx.argmax(a[:, -1:, :], axis=-1)


def _reference_with(path, tokens: list[int], n: int, **kw) -> list[int]:
    """mlx-lm's greedy tokens with its own KV options (kv_bits, or a prompt cache)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))
    if "max_kv_size" in kw:
        from mlx_lm.models.cache import RotatingKVCache

        size = kw.pop("max_kv_size")
        kw["prompt_cache"] = [RotatingKVCache(max_size=size, keep=0) for _ in model.layers]
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n, **kw)]


KV_OPTIONS = {
    "kv_bits4": ({"kv_bits": 4, "kv_group_size": 32}, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}),
    "max_kv_size32": ({"max_kv_size": 32}, {"max_kv_size": 32}),
}


@pytest.mark.parametrize("option", list(KV_OPTIONS))
async def test_kv_options_through_every_path(models, option, tmp_path):
    """``kv_bits`` (quantized KV) and ``max_kv_size`` (a sliding window) as
    mlx-lm has them, with batching, speculation and both tiers: mlx-lm's
    greedy tokens (with the same option) alone, batched, speculating
    batched, from the RAM tier and after an SSD restart."""
    ours, theirs = KV_OPTIONS[option]
    path = models.path("llama", head_dim=32)  # quantized KV groups need head_dim >= 32
    draft = models.path("llama", seed=1)
    cfg = _cfg(path, ssd_cache_dir=str(tmp_path / "ssd"), **ours)
    async with Engine.open(cfg) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        want = [_reference_with(path, p, SP.max_tokens, **theirs) for p in prompts]
        assert (await engine.acomplete(prompts[0], SP)).token_ids == want[0]
        batched = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert [c.token_ids for c in batched] == want
        for _ in range(2):  # the second repeat reads the entry the first one's view wrote past
            again = await engine.acomplete(prompts[1], SP)
            assert again.token_ids == want[1] and again.usage.cached_tokens == len(prompts[1]) - 1
        assert (await engine.aflush()).durable
        assert engine.backend.counters["prefill_together"] >= 2
        if option.startswith("kv_bits"):
            assert engine.backend.counters["pipelined"] > 0  # decode steps ran ahead on quantized KV
        else:
            assert engine.stats()["fallbacks"]["run_ahead_off"] > 0  # a window cannot undo a step run ahead
    async with Engine.open(cfg) as engine:
        warm = await engine.acomplete(prompts[2], SP)
        assert warm.token_ids == want[2] and warm.usage.cached_tokens == len(prompts[2]) - 1
    async with Engine.open(
        _cfg(path, draft_model=str(draft), num_draft_tokens=3, prompt_cache_gib=0, **ours)
    ) as engine:
        spec = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert [c.token_ids for c in spec] == want
        drafted = sum(c.usage.speculation.drafted for c in spec)
        if option.startswith("kv_bits"):
            assert drafted > 0  # quantized KV trims like plain KV
        else:
            assert drafted > 0 or engine.stats()["fallbacks"]["spec_untrimmable"] > 0


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_four_bit_weights(models, arch):
    """The 4-bit quantized variant (mlx-lm's ``quantize_model``, as the
    mlx-community checkpoints are made): mlx-lm's greedy tokens alone and
    batched, and the same prompt again served from the prompt cache."""
    path = models.path(arch, bits=4)
    async with Engine.open(_cfg(path)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        want = [models.reference(path, p, SP.max_tokens) for p in prompts]
        batched = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert [c.token_ids for c in batched] == want
        again = await engine.acomplete(prompts[0], SP)
        assert again.token_ids == want[0] and again.usage.cached_tokens == len(prompts[0]) - 1


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_abort_mid_decode_keeps_the_engine_serving(models, arch):
    """A caller that goes away mid-decode, next to a row that goes on: the
    row leaves the batch (its cache kept, whatever its kind), the other keeps
    mlx-lm's tokens, and the engine serves the next request."""
    path = models.path(arch)
    async with Engine.open(_cfg(path)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        long = SamplingParams(max_tokens=40, ignore_eos=True)

        async def leave_early() -> None:
            async with await engine.asubmit(prompts[0], long) as stream:
                n = 0
                async for d in stream:
                    n += len(d.token_ids)
                    if n >= 4:
                        break

        _, other = await asyncio.gather(leave_early(), engine.acomplete(prompts[1], SP))
        assert other.token_ids == models.reference(path, prompts[1], SP.max_tokens)
        after = await engine.acomplete(prompts[2], SP)
        assert after.token_ids == models.reference(path, prompts[2], SP.max_tokens)
        assert engine.stats()["dead"] is None
        assert engine.stats()["scheduler"]["aborted"] == 1


def test_the_docs_list_every_architecture():
    """docs/compat-matrix.md is this file as a table: every architecture and
    KV option tested here has its row."""
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "compat-matrix.md").read_text()
    rows = [line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ") and "---" not in line]
    for arch in ARCHS:
        assert any(r.replace(",", " ").split(" ")[0] == arch for r in rows), arch
    for option in KV_OPTIONS:
        flag = "--" + option.rstrip("0123456789").replace("_", "-")
        assert any(flag in r for r in rows), option


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ram_tier_counts_the_bytes_a_cache_holds(models, arch):
    """The RAM tier's byte count of an entry is what the entry holds, the
    same bytes the KV file writes: a sliding window past its size holds the
    window, not every token that went through it (counting its offset
    overcounted: 1.46x on this gemma3, ~5x for a real one at 32k tokens)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kv import kvfile
    from engine.mlx.backend import MLXBackend

    model, tokenizer = load(str(models.path(arch)))
    cache = make_prompt_cache(model)
    model(mx.array(tokenizer.encode(PROMPTS[0]))[None], cache=cache)
    for t in range(8):  # decode steps: a ring trims itself to its window
        model(mx.array([[t + 5]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert MLXBackend.cache_nbytes(None, cache) == kvfile.cache_bytes(cache)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["lfm2", "gemma3_text"])
async def test_earlier_checkpoints_are_bounded_and_the_longest_prefix_wins(models, arch):
    """Besides the prompt's end, checkpoints at up to ``max_checkpoints``
    earlier chunk ends ``checkpoint_interval`` apart; a prompt that shares
    only the head of a stored one is served from the longest checkpoint
    inside the shared part, with mlx-lm's tokens."""
    import msgspec

    path = models.path(arch)
    async with Engine.open(_cfg(path, prefill_chunk=8, min_cached_prefix=4)) as engine:
        engine.core.cfg = msgspec.structs.replace(engine.core.cfg, checkpoint_interval=16, max_checkpoints=2)
        prompt = engine.encode(PROMPTS[0])  # 52 tokens: chunk ends 8, 16, 24, ..., 51
        await engine.acomplete(prompt, SP)
        assert engine.stats()["scheduler"]["checkpoints"] == 3  # at 16, 32 and the prompt's end (51)
        other = prompt[:40] + engine.encode("while True:\n    pass\n")
        got = await engine.acomplete(other, SP)
        assert got.usage.cached_tokens == 32
        assert got.token_ids == models.reference(path, other, SP.max_tokens)


@pytest.mark.parametrize("arch", list(ARCHS))
async def test_fan_out_from_a_shared_prefix_prefills_together(models, arch):
    """Three prompts that extend one cached prompt open from it at the same
    offset and prefill their tails in one shared forward (mlx-lm's batch
    caches merged from non-empty row caches: windows, SSM state, lists),
    each with mlx-lm's tokens."""
    path = models.path(arch)
    async with Engine.open(_cfg(path, min_cached_prefix=4)) as engine:
        head = engine.encode(PROMPTS[0])
        await engine.acomplete(head, SP)
        before = engine.backend.counters["prefill_together"]
        tails = [engine.encode(t) for t in ("x = 1\ny = 2\n", "def f():\n    return 0\n", "# done\n")]
        prompts = [head + t for t in tails]
        got = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        cached = {c.usage.cached_tokens for c in got}
        assert len(cached) == 1 and cached.pop() >= len(head) - 1  # plain KV trims the reply's entry: one more
        assert [c.token_ids for c in got] == [models.reference(path, p, SP.max_tokens) for p in prompts]
        assert engine.backend.counters["prefill_together"] - before >= 2


@pytest.mark.parametrize("window", [24, 64, 128])
async def test_run_ahead_on_a_sliding_window_until_it_wraps(models, window):
    """Decode steps run ahead of the Scheduler on a sliding-window model while
    its ring has not wrapped (it can give a step back like plain KV); once it
    would wrap they stop, counted, and the tokens stay mlx-lm's."""
    path = models.path("gemma3_text", sliding_window=window)
    async with Engine.open(_cfg(path, prompt_cache_gib=0)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        sp = SamplingParams(max_tokens=40, ignore_eos=True)
        got = await asyncio.gather(*[engine.acomplete(p, sp) for p in prompts])
        assert [c.token_ids for c in got] == [models.reference(path, p, 40) for p in prompts]
        counters, fallbacks = engine.backend.counters, engine.stats()["fallbacks"]
        if window == 128:  # prompts + 40 tokens stay inside the window
            assert counters["pipelined"] > 0 and fallbacks["run_ahead_off"] == 0
        elif window == 64:  # wraps while decoding: ran ahead, then stopped
            assert counters["pipelined"] > 0 and fallbacks["run_ahead_off"] > 0
        else:  # wrapped from the start
            assert fallbacks["run_ahead_off"] > 0


async def test_kv_bits_on_a_sliding_window_model(models):
    """``kv_bits`` on gemma3: the global layers' KV is quantized, the windows
    stay as they are (mlx-lm cannot quantize a rotating cache: it raises), so
    there is no mlx-lm run to compare with; the oracle is the engine itself
    one row at a time, which batched rows and the repeat (from its
    checkpoint) must match token for token."""
    path = models.path("gemma3_text", head_dim=32, query_pre_attn_scalar=32)
    cfg = _cfg(path, kv_bits=4, kv_group_size=32)
    lone = EngineConfig(model=str(path), max_batch=1, prompt_cache_gib=0, kv_bits=4, kv_group_size=32)
    async with Engine.open(lone) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        alone = [(await engine.acomplete(p, SP)).token_ids for p in prompts]
    async with Engine.open(cfg) as engine:
        batched = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert [c.token_ids for c in batched] == alone
        again = await engine.acomplete(prompts[0], SP)
        assert again.token_ids == alone[0] and again.usage.cached_tokens == len(prompts[0]) - 1
        kinds = {type(c).__name__ for c in engine.prefix_cache.snapshot(prompts[0][:-1], "")}
        assert kinds == {"RotatingKVCache", "QuantizedKVCache"}


async def test_a_failing_batch_cache_or_checkpoint_is_a_counted_fallback(models, monkeypatch):
    """A cache kind whose batch cache or copy fails mid-path (simulated:
    ``ArraysCache.merge`` and the checkpoint copy raise) never reaches the
    engine: the shared prefill falls back to one row at a time and the
    checkpoint is skipped, both counted in /stats; with no batch cache at all
    the rows cannot decode and end with an error; the engine stays up and
    serves the next request with mlx-lm's tokens."""
    from mlx_lm.models.cache import ArraysCache

    import engine.mlx.row_phases as row_phases

    path = models.path("lfm2")

    def broken(*a, **kw):
        raise RuntimeError("simulated: this kind cannot be batched")

    async with Engine.open(_cfg(path)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        want = [models.reference(path, p, SP.max_tokens) for p in prompts]
        monkeypatch.setattr(ArraysCache, "merge", classmethod(lambda cls, caches: broken()))
        monkeypatch.setattr(row_phases, "snapshot_cache", broken)  # where _checkpoint calls it
        # prefill fallback: the three prompts open together (merge raises), prefill alone
        got = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts], return_exceptions=True)
        stats = engine.stats()
        assert stats["fallbacks"]["prefill_alone"] >= 2 and stats["fallbacks"]["checkpoint_failed"] >= 1
        assert stats["dead"] is None
        # the decode batch needs merge too: those rows fail with an error, the engine lives on
        assert all(isinstance(g, Exception) or g.finish_reason == "error" for g in got), got
        monkeypatch.undo()
        after = await engine.acomplete(prompts[1], SP)
        assert after.token_ids == want[1]


# Every KV option on every architecture, with the flags as a user types them:
# mlx-lm's default group size (64) included. A combination that cannot serve a
# model is refused at start, naming the flag and the head dimension; one that
# starts serves mlx-lm's greedy tokens (where mlx-lm can run the option: it
# cannot quantize a rotating window) alone and batched.
MATRIX_OPTIONS = {
    "kv_bits4": {"kv_bits": 4},
    "kv_bits8": {"kv_bits": 8},
    "kv_bits8-group32": {"kv_bits": 8, "kv_group_size": 32},
    "max_kv_size32": {"max_kv_size": 32},
}
# the archs as built (head_dim 16: no group size divides it), and two with head_dim 32
MATRIX_ARCHS = {
    **{arch: {} for arch in ARCHS},
    "gemma3_text-hd32": {"head_dim": 32, "query_pre_attn_scalar": 32},
    "llama-hd32": {"head_dim": 32},
}


def _kv_dims(path: pathlib.Path) -> set[int]:
    """The head dimensions of the model's plain KV layers (what --kv-bits quantizes)."""
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model, _ = load(str(path))
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return {int(x.shape[-1]) for c in cache if type(c) is KVCache for x in (c.keys, c.values)}


def _reference_as_ours(path, tokens: list[int], n: int, **kw) -> list[int]:
    """mlx-lm's greedy tokens with the option: a window replaces the plain KV
    layers only (as ``MLXBackend.make_cache`` does; SSM state stays)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    model, _ = load(str(path))
    if "max_kv_size" in kw:
        size = kw.pop("max_kv_size")
        cache = make_prompt_cache(model)
        kw["prompt_cache"] = [RotatingKVCache(max_size=size, keep=0) if type(c) is KVCache else c for c in cache]
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n, **kw)]


@pytest.mark.heavy  # 40 real-MLX cases: minutes without OpenBLAS
@pytest.mark.parametrize("option", list(MATRIX_OPTIONS))
@pytest.mark.parametrize("arch", list(MATRIX_ARCHS))
async def test_every_kv_option_on_every_arch(models, arch, option):
    from engine.errors import InvalidRequest

    ours = MATRIX_OPTIONS[option]
    path = models.path(arch.split("-")[0], **MATRIX_ARCHS[arch])
    group = ours.get("kv_group_size", 64)
    dims = _kv_dims(path) if "kv_bits" in ours else set()
    if any(d % group for d in dims):
        with pytest.raises(InvalidRequest) as refused:
            async with Engine.open(_cfg(path, **ours)):
                pass
        msg = str(refused.value)
        assert f"--kv-bits {ours['kv_bits']}" in msg and f"head dimension {min(dims)}" in msg
        assert f"--kv-group-size {group}" in msg and refused.value.param == "kv_group_size"
        return
    async with Engine.open(_cfg(path, prompt_cache_gib=0, **ours)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        alone = (await engine.acomplete(prompts[0], SP)).token_ids
        batched = await asyncio.gather(*[engine.acomplete(p, SP) for p in prompts])
        assert engine.dead is None
    assert batched[0].token_ids == alone
    theirs = dict(ours)
    if "kv_bits" in theirs:
        theirs.update(kv_group_size=group, quantized_kv_start=0)
    try:
        want = [_reference_as_ours(path, p, SP.max_tokens, **theirs) for p in prompts]
    except NotImplementedError:  # mlx-lm cannot quantize a RotatingKVCache: the engine alone is the oracle
        return
    assert [c.token_ids for c in batched] == want
