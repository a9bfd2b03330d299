"""The MLX backend at the port: StepPlans in, tokens out, on the MLX thread.

The oracle is mlx-lm itself (``generate_step`` on the same model object, run
on the same thread), never a recorded output. ``EMBER_TEST_MODEL`` may point
at another mlx-lm model directory; the default is the bundled ``tiny``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.mlx.backend import MLXBackend, load_mlx_backend  # noqa: E402
from engine.models import resolve_model  # noqa: E402
from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan, VerifyRow  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # real MLX compute on the model (each test well under a few seconds)

MODEL = os.environ.get("EMBER_TEST_MODEL", "tiny")
KV_TOL = 1e-3  # batched and chunked forwards differ from one full forward by ~1e-5
GREEDY = SamplingParams(max_tokens=10_000, ignore_eos=True)
PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "".join(f"value_{i} = compute({i * 7 % 13}, name='item{i}')\n" for i in range(12)),
]


def _path():
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def mlx():
    backend, device = load_mlx_backend(EngineConfig(backend="mlx", model=str(_path())))
    yield backend, device
    device.close()


@pytest.fixture(scope="module")
def oracle(mlx):
    """The same checkpoint as mlx-lm loads it, on the backend's thread: the
    backend's own model may have its weights laid out for the CPU
    (engine.mlx.cpu_layout), and the oracle must not share that."""
    from mlx_lm import load

    _, device = mlx
    return device.call(lambda: load(str(_path()))[0])


class Rig:
    """Drives one backend with hand-written plans and checks rows against mlx-lm.

    ``deep``: after every step the backend runs ahead as far as it may
    (``max_ahead`` steps), several steps queued ahead of the plans.
    """

    def __init__(self, backend: MLXBackend, device, oracle, deep: bool = False):
        self.b, self.d, self.deep, self.oracle = backend, device, deep, oracle
        self.next_rid = 1000 * (id(self) % 997)

    def step(self, **kw) -> object:
        res = self.d.call(self.b.step, StepPlan(**kw))
        if self.deep:
            self.d.call(self.b.run_ahead, lambda: True)
        return res

    def ids(self, text: str) -> list[int]:
        return self.b.tokenizer.encode(text)

    def reference(self, prompt: list[int], n: int, temp: float = 0.0, seed: int = 0) -> list[int]:
        """n tokens from mlx_lm.generate_step on mlx-lm's own load of the
        checkpoint, on the backend's thread; sampled ones after
        ``mx.random.seed(seed)``, which is what a request with that seed must
        reproduce (engine.mlx.sampling)."""

        def run():
            mx.random.seed(seed)
            gen = generate_step(mx.array(prompt), self.oracle, max_tokens=n, sampler=make_sampler(temp))
            return [t for t, _ in gen]

        return self.d.call(run)

    def kv_error(self, rid: int, tokens: list[int]) -> float:
        """Max |difference| between the row's KV cache and a fresh mlx-lm cache
        fed ``tokens``; inf when the row does not hold exactly that many tokens.
        Tokens alone can hide a wrong cache on a repetitive model; the KV cannot."""

        def run():
            mine = self.b.row_cache(rid)
            ref = make_prompt_cache(self.oracle)
            self.oracle(mx.array(tokens)[None], cache=ref)
            if any(c.offset != len(tokens) for c in mine):
                return float("inf")
            n = len(tokens)
            return max(
                mx.abs(getattr(m, f)[..., :n, :] - getattr(r, f)[..., :n, :]).max().item()
                for m, r in zip(mine, ref)
                for f in ("keys", "values")
            )

        return self.d.call(run)

    def open_prefilled(self, prompt: list[int], sampling=GREEDY, chunk: int = 64) -> int:
        """Open a row and prefill all but its last prompt token."""
        self.next_rid += 1
        rid = self.next_rid
        self.step(open=[OpenRow(rid, sampling)])
        body = prompt[:-1]
        for i in range(0, len(body), chunk):
            res = self.step(prefill=[PrefillChunk(rid, body[i : i + chunk])])
            assert not res.errors
        return rid


@pytest.fixture(params=[False, True], ids=["ahead-1", "ahead-4"])
def rig(mlx, oracle, request):
    r = Rig(*mlx, oracle, deep=request.param)
    r.b.max_ahead = 4 if request.param else 1
    yield r
    r.b.max_ahead = 1
    leftover = list(r.b._rows)  # a failed test must not leave rows in the shared batch
    if leftover:
        r.step(close=leftover)


def test_info_describes_the_model(mlx):
    backend, _ = mlx
    path = _path()
    cfg = json.loads((path / "config.json").read_text())
    info = backend.info
    assert info.vocab_size == cfg["vocab_size"]
    assert info.context_length == cfg["max_position_embeddings"]
    assert info.num_layers == cfg["num_hidden_layers"] == len(backend.make_cache())
    assert info.model_id == str(path)
    assert len(info.config_fingerprint) == 16 and len(info.tokenizer_hash) == 16


def test_fingerprint_follows_graph_config_and_tokenizer(tmp_path):
    src = _path()
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    cfg = json.loads((a / "config.json").read_text())
    # Checkpoint metadata is not part of the graph: the fingerprint ignores it.
    (b / "config.json").write_text(json.dumps({**cfg, "transformers_version": "0.0-test", "eos_token_id": 1}))
    info = [MLXBackend.load(p, EngineConfig(model=str(p))).info for p in (a, b)]
    assert info[0].config_fingerprint == info[1].config_fingerprint
    assert info[0].tokenizer_hash == info[1].tokenizer_hash
    # A graph-shaping change and a tokenizer change are both seen.
    (b / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 2}))
    tok = json.loads((b / "tokenizer.json").read_text())
    tok["added_tokens"] = tok.get("added_tokens", []) + [
        {
            "id": 99999,
            "content": "<|ember-test|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    (b / "tokenizer.json").write_text(json.dumps(tok))
    changed = MLXBackend.load(b, EngineConfig(model=str(b))).info
    assert changed.config_fingerprint != info[0].config_fingerprint
    assert changed.tokenizer_hash != info[0].tokenizer_hash


def test_tokenizer_adapter(mlx):
    tok = mlx[0].tokenizer
    text = "def f(x):\n    return x + 1\n"
    ids = tok.encode(text)
    assert ids and all(isinstance(t, int) for t in ids)
    assert tok.decode(ids) == text
    assert tok.eos_token_ids and all(isinstance(t, int) for t in tok.eos_token_ids)
    # Two detokenizers fed interleaved stay independent (one per request).
    d1, d2 = tok.detokenizer(), tok.detokenizer()
    out1, out2 = [], []
    for t in ids:
        d1.add_token(t)
        out1.append(d1.last_segment)
        d2.add_token(ids[0])
        out2.append(d2.last_segment)
    d1.finalize()
    out1.append(d1.last_segment)
    assert "".join(out1) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert all(isinstance(t, int) for t in chat)
    assert tok.decode(chat).endswith("assistant\n")


def test_decode_matches_generate_step(rig):
    prompt = rig.ids(PROMPTS[3])
    assert len(prompt) > 64  # several prefill chunks
    ref = rig.reference(prompt, 24)
    rid = rig.open_prefilled(prompt)
    out, tok = [], prompt[-1]
    for _ in range(24):
        tok = rig.step(decode=[DecodeRow(rid, tok)]).tokens[rid]
        out.append(tok)
    rig.step(close=[rid])
    assert out == ref


def test_rows_join_and_leave_a_running_batch(rig):
    """Staggered joins and exits; a kept cache holds exactly the fed tokens and
    continues like the original row (the queued step's token is dropped)."""
    prompts = [rig.ids(p) for p in PROMPTS]
    n = 20
    refs = [rig.reference(p, n + 6) for p in prompts]
    rids = [rig.open_prefilled(p) for p in prompts]
    nxt = {rid: p[-1] for rid, p in zip(rids, prompts)}
    out: dict[int, list[int]] = {rid: [] for rid in rids}
    start = {rid: 3 * i for i, rid in enumerate(rids)}  # row i joins at step 3i
    kept = {}
    for t in range(n + 9):
        live = [rid for rid in rids if start[rid] <= t and len(out[rid]) < n]
        done = [rid for rid in rids if len(out[rid]) == n and rid not in kept]
        res = rig.step(close=done, keep_cache=set(done), decode=[DecodeRow(rid, nxt[rid]) for rid in live])
        assert not res.errors
        kept.update(res.closed)
        for rid in live:
            nxt[rid] = res.tokens[rid]
            out[rid].append(res.tokens[rid])
    for rid, ref in zip(rids, refs):
        assert out[rid] == ref[:n]
    assert rig.b.counters["pipelined"] > 0
    # Continue two kept caches: prompt + n-1 generated tokens are in them.
    for i in (0, 2):
        rid, p = rids[i], prompts[i]
        cache = kept[rid]
        assert cache[0].offset == len(p) + n - 1
        rig.next_rid += 1
        new = rig.next_rid
        rig.step(open=[OpenRow(new, GREEDY, cache, len(p) + n - 1)])
        assert rig.kv_error(new, p + out[rid][: n - 1]) < KV_TOL
        tok, cont = out[rid][-1], []
        for _ in range(5):
            tok = rig.step(decode=[DecodeRow(new, tok)]).tokens[new]
            cont.append(tok)
        rig.step(close=[new])
        assert cont == refs[i][n : n + 5]


def test_a_plan_that_skips_a_row_undoes_the_queued_step(rig):
    """b samples (seed 5): undoing the queued step must also give back its PRNG key."""
    pa, pb = rig.ids(PROMPTS[0]), rig.ids(PROMPTS[1])
    ra, rb = rig.reference(pa, 8), rig.reference(pb, 8, temp=0.8, seed=5)
    a = rig.open_prefilled(pa)
    b = rig.open_prefilled(pb, SamplingParams(max_tokens=100, temperature=0.8, seed=5))
    undone = rig.b.counters["undone"]
    res = rig.step(decode=[DecodeRow(a, pa[-1]), DecodeRow(b, pb[-1])])
    out_a, out_b = [res.tokens[a]], [res.tokens[b]]
    res = rig.step(decode=[DecodeRow(a, out_a[-1])])  # b sits this step out
    out_a.append(res.tokens[a])
    assert rig.b.counters["undone"] > undone
    assert rig.kv_error(b, pb) < KV_TOL  # b holds its prompt, nothing queued
    for _ in range(6):
        res = rig.step(decode=[DecodeRow(a, out_a[-1]), DecodeRow(b, out_b[-1])])
        out_a.append(res.tokens[a])
        out_b.append(res.tokens[b])
    rig.step(close=[a, b])
    assert out_a == ra
    assert out_b == rb[:7]


def test_verify_windows_batched_with_decode_and_per_row_trim(rig):
    pa, pb, pc = (rig.ids(p) for p in PROMPTS[:3])
    ra, rb, rc = (rig.reference(p, 12) for p in (pa, pb, pc))
    a, b, c = (rig.open_prefilled(p) for p in (pa, pb, pc))
    # One forward: a verifies 4 correct drafts, b 2 drafts of which the 2nd is
    # wrong, c decodes. Every position returns the target's token.
    wrong = (rb[1] + 1) % rig.b.info.vocab_size
    res = rig.step(
        verify=[VerifyRow(a, [pa[-1], *ra[:4]]), VerifyRow(b, [pb[-1], rb[0], wrong])],
        decode=[DecodeRow(c, pc[-1])],
    )
    assert res.verified[a] == ra[:5]
    assert res.verified[b][:2] == rb[:2]
    assert res.tokens[c] == rc[0]
    # b rejects its wrong draft: drop it (per-row trim while a and c keep theirs).
    res = rig.step(
        trim=[(b, 1)],
        decode=[DecodeRow(a, ra[4]), DecodeRow(b, rb[1]), DecodeRow(c, rc[0])],
    )
    assert (res.tokens[a], res.tokens[b], res.tokens[c]) == (ra[5], rb[2], rc[1])
    assert rig.kv_error(b, pb + rb[:2]) < KV_TOL
    assert rig.kv_error(a, pa + ra[:5]) < KV_TOL
    # Different trims in one step: a rolls back 3 tokens, c 1, b none.
    res = rig.step(
        trim=[(a, 3), (c, 1)],
        decode=[DecodeRow(a, ra[2]), DecodeRow(b, rb[2]), DecodeRow(c, rc[0])],
    )
    assert (res.tokens[a], res.tokens[b], res.tokens[c]) == (ra[3], rb[3], rc[1])
    assert rig.kv_error(a, pa + ra[:3]) < KV_TOL
    assert rig.kv_error(b, pb + rb[:3]) < KV_TOL
    assert rig.kv_error(c, pc + rc[:1]) < KV_TOL
    rig.step(close=[a, b, c])


def test_a_window_rejected_at_its_first_draft_after_a_run_ahead_costs_a_plain_step(rig):
    """The step run ahead fed the window's first token; its first draft is
    wrong, so the drafts are never fed (``stopped``), no trim is owed, and the
    batch keeps running ahead as after any plain step: the next decode takes
    the step computed ahead, and the tokens and KV stay mlx-lm's."""
    p = rig.ids(PROMPTS[2])
    ref = rig.reference(p, 8)
    r = rig.open_prefilled(p)
    assert rig.step(decode=[DecodeRow(r, p[-1])]).tokens[r] == ref[0]
    wrong = [(t + 1) % rig.b.info.vocab_size for t in ref[1:4]]
    heads, stopped = rig.b.counters["ahead_heads_windows"], rig.b.counters["windows_stopped"]
    res = rig.step(verify=[VerifyRow(r, [ref[0], *wrong])])
    owed = []
    if rig.deep:  # several steps ran ahead: they are undone and the window is fed whole
        assert res.verified[r][0] == ref[1] and len(res.verified[r]) == 4 and not res.stopped
        owed = [(r, 3)]
    else:
        assert res.verified[r] == [ref[1]] and res.stopped == {r}
        assert (rig.b.counters["ahead_heads_windows"], rig.b.counters["windows_stopped"]) == (heads + 1, stopped + 1)
        assert rig.kv_error(r, p + ref[:1]) < KV_TOL  # only the window's first token was fed
    pipelined = rig.b.counters["pipelined"]
    out = [ref[0], ref[1]]
    for i in range(4):
        out.append(rig.step(trim=owed if i == 0 else [], decode=[DecodeRow(r, out[-1])]).tokens[r])
    if not rig.deep:
        assert rig.b.counters["pipelined"] >= pipelined + 4  # every one of them was computed ahead
    # A window whose first draft is right is fed on top of the step run ahead.
    res = rig.step(verify=[VerifyRow(r, [out[-1], ref[6], wrong[0]])])
    assert res.verified[r][:2] == ref[6:8] and not res.stopped
    rig.step(close=[r])
    assert out == ref[:6]


def test_trim_back_to_the_prompt_after_two_verify_rounds(rig):
    """The second window goes through the batch's own forward: both must count."""
    p = rig.ids(PROMPTS[1])
    ref = rig.reference(p, 10)
    r = rig.open_prefilled(p)
    assert rig.step(verify=[VerifyRow(r, [p[-1], *ref[:3]])]).verified[r] == ref[:4]
    assert rig.step(verify=[VerifyRow(r, ref[3:7])]).verified[r] == ref[4:8]
    rig.step(trim=[(r, len(p) + 5)])  # back to the first 2 prompt tokens
    assert rig.kv_error(r, p[:2]) < KV_TOL
    assert rig.step(verify=[VerifyRow(r, p[2:])]).verified[r][-1] == ref[0]
    rig.step(close=[r])


def test_one_token_prompt_opens_and_decodes_in_one_step(rig):
    p = rig.ids(PROMPTS[0])[:1]
    ref = rig.reference(p, 4)
    rig.next_rid += 1
    r = rig.next_rid
    out = [rig.step(open=[OpenRow(r, GREEDY)], decode=[DecodeRow(r, p[0])]).tokens[r]]
    for _ in range(3):
        out.append(rig.step(decode=[DecodeRow(r, out[-1])]).tokens[r])
    rig.step(close=[r])
    assert out == ref


def test_verify_on_a_row_that_has_not_joined_yet(rig):
    p = rig.ids(PROMPTS[2])
    ref = rig.reference(p, 6)
    r = rig.open_prefilled(p)
    res = rig.step(verify=[VerifyRow(r, [p[-1], *ref[:3]])])
    assert res.verified[r] == ref[:4]
    res = rig.step(decode=[DecodeRow(r, ref[3])])
    assert res.tokens[r] == ref[4]
    rig.step(close=[r])


def test_open_from_a_prefix_cache_holding_the_whole_prompt(rig):
    """mlx_lm.server 0.32.2 dies on an exact hit; here the cache is trimmed to
    ``cached`` and the last prompt token is fed."""
    p = rig.ids(PROMPTS[1])
    ref = rig.reference(p, 6)
    src = rig.open_prefilled(p)
    rig.step(prefill=[PrefillChunk(src, p[-1:])])  # now the whole prompt is cached
    cache = rig.step(close=[src], keep_cache={src}).closed[src]
    assert cache[0].offset == len(p)
    rig.next_rid += 1
    r = rig.next_rid
    rig.step(open=[OpenRow(r, GREEDY, cache, len(p) - 1)])
    out, tok = [], p[-1]
    for _ in range(6):
        tok = rig.step(decode=[DecodeRow(r, tok)]).tokens[r]
        out.append(tok)
    rig.step(close=[r])
    assert out == ref


def test_cache_ops_count_real_bytes_and_views_are_private(rig):
    p = rig.ids(PROMPTS[3])[:40]
    r = rig.open_prefilled(p)
    cache = rig.step(close=[r], keep_cache={r}).closed[r]
    b = rig.b
    cfg = json.loads((_path() / "config.json").read_text())
    kv_heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * cache[0].keys.dtype.size
    assert rig.d.call(b.cache_nbytes, cache) == per_token * (len(p) - 1)
    assert sum(c.nbytes for c in cache) > per_token * (len(p) - 1)  # mlx-lm counts capacity
    from engine.mlx.cache_views import prefix_view

    clone = rig.d.call(prefix_view, cache, len(p) - 1)  # what a row opened from a prompt-cache hit gets
    assert rig.d.call(b.cache_trimmable, clone)
    assert rig.d.call(b.trim_cache, clone, 10) == 10
    assert clone[0].offset == len(p) - 11 and cache[0].offset == len(p) - 1

    # Writing into the view leaves the original intact.
    def snapshot():
        return [mx.array(c.keys[..., : c.offset, :]) for c in cache]

    def write_clone():
        mx.eval(b.model(mx.array([p[-12:]]), cache=clone))

    before = rig.d.call(snapshot)
    rig.d.call(write_clone)
    after = rig.d.call(snapshot)
    assert clone[0].offset == len(p) + 1
    assert rig.d.call(lambda: all(mx.array_equal(x, y).item() for x, y in zip(before, after)))


def test_caches_handed_out_are_taken_on_another_thread_and_opened_on_the_mlx_one(rig):
    """The prompt-cache tier takes a prefix between steps on the event-loop
    thread; the row that opens with it cuts the view on the MLX thread."""
    from engine.mlx.cache_views import CachePrefix

    p = rig.ids(PROMPTS[0])
    r = rig.open_prefilled(p)
    rig.step(decode=[DecodeRow(r, p[-1])])
    cache = rig.step(close=[r], keep_cache={r}).closed[r]
    pending = rig.b.prefix_view(cache, len(p))  # this (test) thread, not the MLX one
    assert isinstance(pending, CachePrefix) and pending.n == len(p)
    rig.next_rid += 1
    res = rig.step(open=[OpenRow(rig.next_rid, GREEDY, pending, len(p) - 1)], decode=[DecodeRow(rig.next_rid, p[-1])])
    assert not res.errors and rig.next_rid in res.tokens
    rig.step(close=[rig.next_rid])


def test_bad_rows_are_reported_per_row(rig):
    p = rig.ids(PROMPTS[0])
    res = rig.step(prefill=[PrefillChunk(424242, p)], decode=[DecodeRow(424243, 1)])
    assert set(res.errors) == {424242, 424243}
    rig.next_rid += 1
    res = rig.step(open=[OpenRow(rig.next_rid, GREEDY, rig.d.call(rig.b.make_cache), 5)])
    assert rig.next_rid in res.errors
    # The backend still serves new rows.
    ref = rig.reference(p, 3)
    r = rig.open_prefilled(p)
    out, tok = [], p[-1]
    for _ in range(3):
        tok = rig.step(decode=[DecodeRow(r, tok)]).tokens[r]
        out.append(tok)
    rig.step(close=[r])
    assert out == ref


def test_out_of_memory_is_a_memory_error(rig, monkeypatch):
    p = rig.ids(PROMPTS[0])
    r = rig.open_prefilled(p)
    real = rig.b.model

    def boom(*a, **kw):
        raise RuntimeError("[malloc] Unable to allocate 1099511627776 bytes.")

    monkeypatch.setattr(rig.b, "model", boom)
    with pytest.raises(MemoryError):
        rig.step(decode=[DecodeRow(r, p[-1])])
    monkeypatch.setattr(rig.b, "model", real)
    res = rig.step(decode=[DecodeRow(r, p[-1])])
    assert r in res.errors  # its state was dropped: a per-row error, not a crash
    ref = rig.reference(p, 2)
    r2 = rig.open_prefilled(p)
    res = rig.step(decode=[DecodeRow(r2, p[-1])])
    assert res.tokens[r2] == ref[0]
    rig.step(close=[r, r2])


def test_seeded_sampling_does_not_depend_on_the_batch(rig):
    p = rig.ids(PROMPTS[0])
    hot = SamplingParams(max_tokens=10_000, temperature=1.0, top_p=0.95, seed=11)

    def run(with_neighbours: bool) -> list[int]:
        r = rig.open_prefilled(p, hot)
        nxt = {r: p[-1]}
        for i, q in enumerate(PROMPTS[1:3] if with_neighbours else []):
            ids = rig.ids(q)
            nxt[rig.open_prefilled(ids, SamplingParams(temperature=0.7, seed=i))] = ids[-1]
        out = []
        for _ in range(16):
            res = rig.step(decode=[DecodeRow(x, nxt[x]) for x in nxt])
            nxt = {x: res.tokens[x] for x in nxt}
            out.append(res.tokens[r])
        rig.step(close=list(nxt))
        return out

    alone = run(False)
    assert run(True) == alone
    assert run(False) == alone


def test_fingerprint_covers_the_kv_scheme():
    from engine.mlx.model_identity import config_fingerprint

    cfg = {"model_type": "llama", "hidden_size": 8}
    assert config_fingerprint(cfg, ["KVCache"]) == config_fingerprint(dict(cfg), ["KVCache"])
    assert config_fingerprint(cfg, ["KVCache"]) != config_fingerprint(cfg, ["RotatingKVCache"])


def test_mlx_thread_runs_everything_on_one_thread():
    import asyncio
    import threading

    from engine.mlx.device import MLXThread

    dev = MLXThread()
    seen: list[int] = []

    def where(x: int) -> int:
        seen.append(threading.get_ident())
        return x * 2

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        assert await dev.run(where, 21) == 42
        with pytest.raises(ValueError, match="boom"):
            await dev.run(fail)
        # A cancelled waiter does not break the thread for the next caller.
        task = asyncio.ensure_future(dev.run(where, 1))
        task.cancel()
        assert await dev.run(where, 2) == 4

    asyncio.run(main())
    assert dev.call(where, 5) == 10
    assert dev.submit(where, 6).result() == 12
    dev.close()
    assert set(seen) == {dev.thread_ident} and dev.thread_ident != threading.get_ident()
    with pytest.raises(RuntimeError):
        dev.submit(where, 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux-only")
def test_the_mlx_thread_carries_its_name_in_the_os():
    """top -H, perf and /proc (bench.cpu.cpu_per_token) tell the MLX thread apart by it."""
    import os
    import threading

    from engine.mlx.device import MLXThread

    dev = MLXThread()
    try:
        tid = dev.call(threading.get_native_id)
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            assert f.read().strip() == "ember-mlx"
    finally:
        dev.close()


def test_retrained_weights_change_the_fingerprint(tmp_path):
    """SSD entries are keyed by the fingerprint: new weights under an unchanged
    config must not restore KV computed by the old ones."""
    import shutil

    import mlx.core as mx

    from engine.mlx.model_identity import weights_digest
    from engine.models import resolve_model

    src = resolve_model("tiny")
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    assert weights_digest(a) == weights_digest(b)
    weights = mx.load(str(b / "model.safetensors"))
    weights = {k: (v * 1.001 if k.endswith("norm.weight") or "embed" in k else v) for k, v in weights.items()}
    mx.save_safetensors(str(b / "model.safetensors"), weights, metadata={"format": "mlx"})
    assert weights_digest(a) != weights_digest(b)


@pytest.mark.parametrize("together", [True, False], ids=["together", "alone"])
def test_rows_prefilled_in_one_step(rig, together):
    """Chunks of rows at the same offset go through one right-padded forward.
    Every row's KV cache must match the one its own chunk-by-chunk B=1 prefill
    builds (exactly when ``prefill_together`` is off, within fp32 GEMM noise
    when on), and its greedy tokens must equal mlx-lm's."""
    rig.b.prefill_together = together
    prompts = [rig.ids(p) for p in PROMPTS]
    refs = [rig.reference(p, 8) for p in prompts]
    rids = []
    for _ in prompts:
        rig.next_rid += 1
        rids.append(rig.next_rid)
    rig.step(open=[OpenRow(rid, GREEDY) for rid in rids])
    before = rig.b.counters["prefill_together"]
    # Step 1: the four rows from offset 0 with different lengths (one group);
    # step 2: rows 0 and 2 at offset 4 (a group from a non-empty cache), rows 1
    # and 3 alone (offsets 3 and 7).
    bodies = [p[:-1] for p in prompts]
    assert [len(b) > 7 for b in bodies] == [True, False, True, True]
    first = {rids[0]: bodies[0][:4], rids[1]: bodies[1][:3], rids[2]: bodies[2][:4], rids[3]: bodies[3][:7]}
    res = rig.step(prefill=[PrefillChunk(rid, toks) for rid, toks in first.items()])
    assert not res.errors
    res = rig.step(
        prefill=[
            PrefillChunk(rid, body[len(first[rid]) :]) for rid, body in zip(rids, bodies) if len(body) > len(first[rid])
        ]
    )
    assert not res.errors
    assert rig.b.counters["prefill_together"] - before == (6 if together else 0)

    # Alone, a row's prefill is exactly mlx-lm's B=1 chunk-by-chunk prefill on
    # the same weights: the backend's model (its CPU layout moves few-token
    # chunks by ~1e-6 from mlx-lm's own load, engine.mlx.cpu_layout); tokens are
    # still checked against the oracle below.
    model = rig.oracle if together else rig.b.model

    def kv_diff(rid: int, tokens: list[int]) -> float:
        def run():
            mine, ref = rig.b.row_cache(rid), make_prompt_cache(model)
            cut = len(first[rid])  # the reference prefills in the same chunks
            for part in (tokens[:cut], tokens[cut:]):
                if part:
                    model(mx.array(part)[None], cache=ref)
            n = len(tokens)
            if any(m.offset != n for m in mine):
                return float("inf")
            return max(
                mx.abs(getattr(m, f)[..., :n, :] - getattr(r, f)[..., :n, :]).max().item()
                for m, r in zip(mine, ref)
                for f in ("keys", "values")
            )

        return rig.d.call(run)

    try:
        for rid, body in zip(rids, bodies):
            diff = kv_diff(rid, body)
            assert diff < 1e-4 if together else diff == 0.0, (rid, diff)
        out = {rid: [] for rid in rids}
        nxt = {rid: p[-1] for rid, p in zip(rids, prompts)}
        for _ in range(8):
            res = rig.step(decode=[DecodeRow(rid, nxt[rid]) for rid in rids])
            for rid in rids:
                nxt[rid] = res.tokens[rid]
                out[rid].append(res.tokens[rid])
        assert [out[rid] for rid in rids] == refs
    finally:
        rig.b.prefill_together = True
        rig.step(close=rids)


def test_one_token_steps_skip_the_mask_only_without_padding(mlx, monkeypatch):
    """A batch whose rows have no left padding decodes without building the
    all-True mask (and gives mlx-lm's own KVCache logits, bit for bit); once a
    row with padding joins, the mask is back."""
    from mlx_lm.models.cache import BatchKVCache

    from engine.mlx.batch import DecodeBatch, merge_caches

    backend, device = mlx
    calls = []
    real = BatchKVCache.make_mask
    monkeypatch.setattr(BatchKVCache, "make_mask", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))

    def run():
        model = backend.model
        a, b = backend.tokenizer.encode(PROMPTS[3]), backend.tokenizer.encode(PROMPTS[2])
        ref, mine = make_prompt_cache(model), make_prompt_cache(model)
        model(mx.array(a[:-1])[None], cache=ref)
        model(mx.array(a[:-1])[None], cache=mine)
        batch = DecodeBatch()
        batch.add([1], merge_caches([mine]))
        assert batch.aligned()
        got = batch.decode(model, mx.array([a[-1]]))
        want = model(mx.array([[a[-1]]]), cache=ref)
        same = mx.array_equal(got, want).item()
        n_aligned = len(calls)
        other = make_prompt_cache(model)
        model(mx.array(b[:-1])[None], cache=other)
        batch.add([2], merge_caches([other]))
        aligned_after = batch.aligned()
        batch.decode(model, mx.array([7, b[-1]]))
        return same, n_aligned, aligned_after, len(calls)

    same, n_aligned, aligned_after, n_total = device.call(run)
    assert same
    assert n_aligned == 0
    assert not aligned_after and n_total == 1


@pytest.mark.parametrize("n, fed", [(20, 20), (40, 39)], ids=["prefix", "exact-hit-trimmed"])
def test_a_prefix_view_continues_exactly_and_leaves_the_stored_cache_as_it_was(mlx, n, fed):
    """``prefix_view`` hands out lazy slices of a stored cache; the row's next
    forward must give what a cache prefilled the same way gives, and writing
    into the view (even at a position the stored arrays hold, the exact-hit
    case trimmed by one) must not change the stored arrays."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from engine.mlx.cache_views import CachePrefix, prefix_view

    backend, device = mlx
    model = backend.model
    ids = list(range(3, 43))  # 40 tokens
    suffix = [7, 11, 13]

    def run() -> None:
        stored = make_prompt_cache(model)
        mx.eval(model(mx.array([ids]), cache=stored))
        before = [(np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :])) for c in stored]

        pending = backend.prefix_view(stored, n)  # what PromptCache.take gets on the loop
        assert isinstance(pending, CachePrefix) and pending.n == n
        view = prefix_view(pending.cache, pending.n)  # what _open makes of it on the MLX thread
        assert all(c.offset == n for c in view)
        if fed < n:
            assert backend.trim_cache(view, n - fed) == n - fed
        feed = ids[fed:n] + suffix
        got = model(mx.array([feed]), cache=view)

        # The oracle: an owned copy of the whole entry trimmed to what was
        # fed (what take() handed out before). A cache prefilled with only the
        # first n tokens is not one: a 40-token forward computes their keys
        # ~1e-6 apart from a 20-token one (another GEMM shape).
        owned = make_prompt_cache(model)
        for o, c in zip(owned, stored):
            o.keys, o.values, o.offset = mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset
        trim_prompt_cache(owned, 40 - fed)
        want = model(mx.array([feed]), cache=owned)
        assert np.array_equal(np.array(got), np.array(want))
        for c, (k, v) in zip(stored, before):
            assert c.offset == 40
            assert np.array_equal(np.array(c.keys[..., :40, :]), k) and np.array_equal(
                np.array(c.values[..., :40, :]), v
            )

    device.call(run)


def test_a_prefix_view_refuses_more_tokens_than_the_cache_holds(mlx):
    from mlx_lm.models.cache import make_prompt_cache

    backend, device = mlx

    def run() -> None:
        stored = make_prompt_cache(backend.model)
        mx.eval(backend.model(mx.array([[5, 6, 7]]), cache=stored))
        with pytest.raises(ValueError, match="holds 3 tokens"):
            backend.prefix_view(stored, 4)  # checked on the loop, before anything is cut

    device.call(run)


def test_long_prefill_chunks_take_the_softmax_kernel_and_match_mlx_lm(rig):
    """Chunks of 256 tokens run their attention's softmax in the C kernel
    (engine.mlx.kernel_attention, on the backend's attention threads); tokens
    and KV are mlx-lm's, whose own forward (the oracle) never takes it."""
    from engine.mlx import kernel_attention, split_attention

    parts = split_attention.default_parts()
    assert rig.b.counters["attention_streams"] == parts == rig.b.attention_parts
    # a machine that runs the suite builds the kernel (tests/engine/test_softmax_kernel.py)
    assert rig.b.counters["softmax_kernel"] == 1 and rig.b.softmax_kernel is not None
    # and MLX's buffer cache holds a long prefill's score matrices (engine.mlx.buffer_cache)
    assert rig.b.counters["buffer_cache_mib"] >= 32
    prompt = rig.ids("".join(PROMPTS) * 6)
    assert len(prompt) > 3 * 256
    ref = rig.reference(prompt, 12)
    before = kernel_attention.calls["kernel"]
    rid = rig.open_prefilled(prompt, chunk=256)
    layers = len(rig.b.model.layers)
    assert kernel_attention.calls["kernel"] - before >= layers * (len(prompt) // 256)
    assert rig.kv_error(rid, prompt[:-1]) < KV_TOL
    out, tok = [], prompt[-1]
    for _ in range(12):
        tok = rig.step(decode=[DecodeRow(rid, tok)]).tokens[rid]
        out.append(tok)
    rig.step(close=[rid])
    assert out == ref
