"""The engine end to end on the deterministic fake GPU, in virtual time."""

from __future__ import annotations

import random
import threading

import anyio
import pytest

from ember import Engine, EngineConfig, EngineDead, EngineOverloaded, FakeGPUConfig, InvalidRequest, SamplingParams
from engine.eventlog import EventLog
from engine.fake.gpu import FakeBackend, expected_tokens
from engine.fake.tokenizer import ByteTokenizer

pytestmark = pytest.mark.anyio

FAKE = EngineConfig(backend="fake", max_batch=8, max_queue=128, prefill_chunk=64)


def steps_with(log: EventLog, key: str, rid: int) -> list[int]:
    return [f["n"] for _, f in log.of("step") if rid in (f[key] if key != "prefill" else [r for r, _ in f[key]])]


async def run_workload(seed: int, n: int = 100) -> tuple[str, dict[int, list[int]], dict[int, list[int]]]:
    rng = random.Random(seed)
    log = EventLog()
    got: dict[int, list[int]] = {}
    want: dict[int, list[int]] = {}
    async with Engine.open(FAKE, events=log) as engine:

        async def client(i: int, delay: float, prompt: list[int], max_tokens: int) -> None:
            await anyio.sleep(delay)
            c = await engine.acomplete(prompt, SamplingParams(max_tokens=max_tokens))
            got[i] = c.token_ids
            assert c.usage is not None and c.usage.completion_tokens == len(c.token_ids)

        async with anyio.create_task_group() as tg:
            t = 0.0
            for i in range(n):
                t += rng.expovariate(20.0)
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 300))]
                max_tokens = rng.randint(1, 40)
                want[i] = expected_tokens(prompt, max_tokens)
                tg.start_soon(client, i, t, prompt, max_tokens)
    return log.digest(), got, want


async def test_100_seeded_requests_finish_with_exact_tokens_and_stable_digest():
    digest1, got, want = await run_workload(seed=1234)
    assert len(got) == 100
    assert got == want
    digest2, got2, _ = await run_workload(seed=1234)
    assert digest1 == digest2
    assert got2 == got
    digest3, _, _ = await run_workload(seed=99)
    assert digest3 != digest1


async def test_request_admitted_mid_batch_joins_at_next_step():
    log = EventLog()
    async with Engine.open(FAKE, events=log) as engine:
        first_tokens = anyio.Event()
        results = {}

        async def long_request():
            n = 0
            async for d in engine.agenerate([1, 2, 3], SamplingParams(max_tokens=50)):
                n += len(d.token_ids)
                if n >= 5:
                    first_tokens.set()
            results["a"] = n

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await first_tokens.wait()
            steps_before = engine.core.steps
            c = await engine.acomplete([9, 9, 9, 9], SamplingParams(max_tokens=3))
            results["b"] = c.token_ids
        assert results["b"] == expected_tokens([9, 9, 9, 9], 3)
        # rid 2 is opened, prefilled and decoded in the very next step, while rid 1 is mid-batch.
        assert steps_with(log, "open", 2) == [steps_before + 1]
        assert steps_with(log, "decode", 2)[0] == steps_before + 1
        assert steps_before + 1 in steps_with(log, "decode", 1)
        assert results["a"] == 50


async def test_abort_frees_the_row_at_the_next_step():
    log = EventLog()
    async with Engine.open(FAKE, events=log) as engine:
        got = []
        async for d in engine.agenerate([5, 6, 7], SamplingParams(max_tokens=1000)):
            got.extend(d.token_ids)
            if len(got) >= 4:
                break  # the caller goes away
        await anyio.sleep(1)
        abort_t = log.of("abort")[0][0]
        steps_after = [f for t, f in log.of("step") if t >= abort_t]
        assert steps_after[0]["close"] == [1]
        assert all(1 not in f["decode"] for f in steps_after)
        stats = engine.stats()["scheduler"]
        assert stats["aborted"] == 1 and stats["active_rows"] == 0
        # no more tokens were generated for it after the step that noticed the abort
        assert stats["generated_tokens"] <= len(got) + 1


async def test_overload_answers_engine_overloaded():
    cfg = EngineConfig(backend="fake", max_batch=1, max_queue=1)
    async with Engine.open(cfg) as engine:
        running = engine.agenerate([1], SamplingParams(max_tokens=100))
        await running.__anext__()  # in the batch

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.acomplete, [2], SamplingParams(max_tokens=1))  # queued
            await anyio.wait_all_tasks_blocked()
            assert engine.stats()["gateway"]["in_flight"] == 2
            with pytest.raises(EngineOverloaded):
                await engine.acomplete([3], SamplingParams(max_tokens=1))
            assert engine.stats()["gateway"]["rejected"]["overloaded"] == 1
            # nothing waits on the admission path: the rejection was immediate
            assert engine.scheduler.ref.statistics().tasks_waiting_send == 0
            await running.aclose()


async def test_invalid_requests_are_rejected_without_harming_others():
    async with Engine.open(FAKE) as engine:
        with pytest.raises(InvalidRequest):
            await engine.acomplete([], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequest) as e:
            await engine.acomplete([1], SamplingParams(max_tokens=0))
        assert e.value.param == "max_tokens"
        with pytest.raises(InvalidRequest):
            await engine.acomplete([1] * 40_000, SamplingParams(max_tokens=4))
        c = await engine.acomplete([1, 2], SamplingParams(max_tokens=4))
        assert c.token_ids == expected_tokens([1, 2], 4)


class CrashingBackend(FakeBackend):
    def __init__(self, crash_at: int):
        super().__init__(FakeGPUConfig())
        self.crash_at = crash_at

    def step(self, plan):
        if self.steps + 1 == self.crash_at:
            raise RuntimeError("GPU driver bug")
        return super().step(plan)


async def test_a_crashing_actor_gives_engine_dead_to_every_waiter():
    outcomes: list[object] = []
    async with Engine.open(FAKE, backend=CrashingBackend(crash_at=6)) as engine:

        async def client(i):
            try:
                await engine.acomplete([i + 1] * 10, SamplingParams(max_tokens=100))
                outcomes.append("finished")
            except EngineDead as exc:
                outcomes.append("dead")
                messages.append(str(exc))

        messages: list[str] = []
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(client, i)
        assert outcomes == ["dead"] * 5
        # every waiter is told the cause, not the cancellation that stopped the other actors
        assert all("GPU driver bug" in m for m in messages), messages
        assert engine.dead is not None and "GPU driver bug" in repr(engine.dead)
        with pytest.raises(EngineDead):
            await engine.acomplete([1], SamplingParams(max_tokens=1))


class SlowBackend(FakeBackend):
    """Every step costs ``cost_s``; step ``hang_at`` never ends."""

    def __init__(self, cost_s: float, hang_at: int | None = None):
        super().__init__(FakeGPUConfig())
        self.cost_s, self.hang_at, self.planned = cost_s, hang_at, 0

    def step_cost_s(self, plan):
        self.planned += 1
        return float("inf") if self.planned == self.hang_at else self.cost_s


async def test_the_step_watchdog_kills_a_hung_step_at_its_deadline_only():
    """Steps of 0.6 s under a 1 s timeout run for far longer than 1 s in all
    without tripping it (the deadline is per step); step 5 hangs and the
    engine dies exactly 1 s after it began."""
    cfg = EngineConfig(backend="fake", max_batch=8, max_queue=128, prefill_chunk=64, step_timeout_s=1.0)
    log = EventLog()
    async with Engine.open(cfg, backend=SlowBackend(0.6), events=log) as engine:
        c = await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=8))
        assert c.token_ids == expected_tokens([1, 2, 3], 8)
        assert engine.dead is None
        assert len(log.of("step")) >= 5
    log = EventLog()
    async with Engine.open(cfg, backend=SlowBackend(0.6, hang_at=5), events=log) as engine:
        with pytest.raises(EngineDead):
            await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=8))
        assert "GPU step 5 hung past 1.0s" in repr(engine.dead)
        t5 = next(t for t, f in log.of("step") if f["n"] == 5)
        assert anyio.current_time() - (log.origin or 0.0) == pytest.approx(t5 + 1.0)


async def test_out_of_memory_fails_only_that_step_and_engine_survives():
    backend = FakeBackend(FakeGPUConfig(oom_step_prob=0.3, fault_seed=3))
    ok = failed = 0
    async with Engine.open(FAKE, backend=backend) as engine:
        for i in range(10):
            try:
                c = await engine.acomplete([i, i + 1], SamplingParams(max_tokens=5))
                assert c.token_ids == expected_tokens([i, i + 1], 5)
                ok += 1
            except Exception as exc:  # noqa: BLE001
                assert type(exc).__name__ == "RequestFailed"
                failed += 1
        assert engine.dead is None
    assert ok > 0 and failed > 0


async def test_stop_strings_across_token_boundaries_and_eos():
    prompt = list(b"the prompt")
    full = expected_tokens(prompt, 30)
    text = ByteTokenizer().decode(full)
    stop = text[10:13]  # three bytes: spans three tokens
    async with Engine.open(FAKE) as engine:
        c = await engine.acomplete(prompt, SamplingParams(max_tokens=30, stop=[stop]))
        assert c.finish_reason == "stop"
        assert c.text == text[: text.index(stop)]
        c2 = await engine.acomplete(prompt, SamplingParams(max_tokens=30))
        assert c2.finish_reason == "length" and c2.text == text
    eos_cfg = FakeGPUConfig(eos_bias=12.0)
    async with Engine.open(EngineConfig(backend="fake", fake=eos_cfg)) as engine:
        c = await engine.acomplete(prompt, SamplingParams(max_tokens=50))
        want = expected_tokens(prompt, 50, eos_cfg)
        assert want[-1] == ByteTokenizer.EOS and len(want) < 50
        assert c.finish_reason == "stop" and c.token_ids == want[:-1]


async def test_seeded_sampling_is_reproducible():
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=42)
    async with Engine.open(FAKE) as engine:
        a = await engine.acomplete([1, 2, 3], params)
        b = await engine.acomplete([1, 2, 3], params)
        c = await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=43))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_long_prompt_is_chunked_and_does_not_starve_decode():
    log = EventLog()
    async with Engine.open(FAKE, events=log) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.acomplete, [1, 2], SamplingParams(max_tokens=30))
            await anyio.sleep(0.05)
            tg.start_soon(engine.acomplete, [7] * 1000, SamplingParams(max_tokens=2))
        chunks = [n for _, f in log.of("step") for r, n in f["prefill"] if r == 2]
        assert sum(chunks) == 999 and max(chunks) <= FAKE.prefill_chunk
        prefill_steps = steps_with(log, "prefill", 2)
        # while rid 2 prefills, rid 1 keeps decoding every step
        decode_1 = set(steps_with(log, "decode", 1))
        assert [s for s in prefill_steps if s <= max(decode_1)] == [s for s in prefill_steps if s in decode_1]


def test_start_stop_leaves_no_thread_behind():
    before = threading.active_count()
    engine = Engine.start(FAKE)
    c = engine.complete("hello", SamplingParams(max_tokens=5))
    assert c.token_ids == expected_tokens(list(b"hello"), 5)
    deltas = list(engine.generate("hello", SamplingParams(max_tokens=5)))
    assert [t for d in deltas for t in d.token_ids] == c.token_ids
    assert deltas[-1].finish_reason == "length"
    engine.stop()
    assert threading.active_count() == before


async def test_non_integer_token_ids_are_a_clear_error_not_a_dead_engine():
    async with Engine.open(FAKE) as engine:
        with pytest.raises(InvalidRequest):
            await engine.acomplete([1, "x", 2.5], SamplingParams(max_tokens=2))  # type: ignore[list-item]
        for bad in ([1, -1], [1, engine.info.vocab_size], [True, 2]):  # out of range; a bool is no token id
            with pytest.raises(InvalidRequest):
                await engine.acomplete(bad, SamplingParams(max_tokens=2))
        assert engine.dead is None
        c = await engine.acomplete([1, 2], SamplingParams(max_tokens=2))
        assert c.token_ids == expected_tokens([1, 2], 2)


async def test_a_timeout_around_the_stream_loses_no_delta():
    """RequestStream is cancel-safe: a reader that waits for each delta with a
    deadline (a server sending keep-alives) still gets every token, once."""
    async with Engine.open(FAKE) as engine:
        prompt, n = [9, 8, 7], 30
        got: list[int] = []
        timeouts = 0
        async with await engine.asubmit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) as stream:
            while not stream.finished:
                # a deadline shorter than one decode step (10.5 ms); a timer task
                # rather than move_on_after, whose deadline is off the loop's
                # microsecond grid (see docs/sims.md)
                async with anyio.create_task_group() as tg:

                    async def timer() -> None:
                        nonlocal timeouts
                        await anyio.sleep(0.004)
                        timeouts += 1
                        tg.cancel_scope.cancel()

                    async def reader() -> None:
                        d = await stream.__anext__()
                        got.extend(d.token_ids)
                        tg.cancel_scope.cancel()

                    tg.start_soon(timer)
                    tg.start_soon(reader)
        assert timeouts > 0
        assert got == expected_tokens(prompt, n, stop_at_eos=False)


def test_vectorized_running_hashes_equal_the_token_by_token_hash():
    """The fake GPU's prefill (and the simulator's oracle) hash a prompt in a
    few numpy steps; it must be exactly ``_advance`` applied token by token,
    across the loop/vectorized threshold and past the first power table."""
    from engine.fake.logits import HASH_MOD, _advance, advance_all, running_hashes

    rng = random.Random(3)
    for n in [0, 1, 16, 17, 100, 2049, 5000]:
        toks = [rng.randrange(ByteTokenizer.vocab_size) for _ in range(n)]
        h = rng.randrange(HASH_MOD)
        want, x = [], h
        for t in toks:
            x = _advance(x, t)
            want.append(x)
        assert running_hashes(h, toks).tolist() == want
        assert advance_all(h, toks) == x


def test_fake_sampling_draws_from_the_nucleus_with_its_probabilities():
    """sample_token's temperature + top-p path (one sort for the cut and the
    draw) against the distribution it must follow, computed directly."""
    import numpy as np

    from engine.fake.logits import fake_logits
    from engine.fake.sampling import sample_token

    logits = fake_logits(0, 4242, ByteTokenizer.vocab_size)
    for temperature, top_p in [(0.7, 0.95), (1.5, 0.9), (1.0, 1.0)]:
        sp = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=1)
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1 if top_p < 1.0 else p.size
        want = np.zeros_like(p)
        want[order[:cut]] = p[order[:cut]] / p[order[:cut]].sum()
        rng = np.random.Generator(np.random.PCG64(7))
        n = 20_000
        got = np.bincount([sample_token(logits, sp, rng) for _ in range(n)], minlength=p.size) / n
        assert got[want == 0].sum() == 0  # nothing outside the nucleus
        assert 0.5 * np.abs(got - want).sum() < 0.03  # total variation: sampling noise only


def test_fake_sampling_memo_gives_the_draws_of_a_fresh_computation():
    """The nucleus of read-only ``fake_logits`` is memoized by array identity;
    interleaved parameters on the same array, and a writable copy (never
    memoized), must draw exactly the same tokens from the same stream."""
    import numpy as np

    from engine.fake.logits import fake_logits
    from engine.fake.sampling import sample_token

    logits = fake_logits(0, 777, ByteTokenizer.vocab_size)
    params = [
        SamplingParams(max_tokens=1, temperature=t, top_p=q)
        for t, q in [(0.7, 0.9), (1.3, 0.5), (0.7, 1.0), (0.7, 0.9)]
    ]
    a, b = np.random.Generator(np.random.PCG64(3)), np.random.Generator(np.random.PCG64(3))
    memo = [sample_token(logits, sp, a) for _ in range(50) for sp in params]
    fresh = [sample_token(logits.copy(), sp, b) for _ in range(50) for sp in params]
    assert memo == fresh and len(set(memo)) > 3


async def test_a_reader_that_waits_for_the_end_is_woken_once_with_every_delta_queued():
    from actors.gateway import delta_stream
    from actors.runtime import Failure
    from ember.api import Delta
    from engine.errors import RequestFailed

    woke = []

    async def reader(recv, out):
        while True:
            item = await recv.receive()
            woke.append(anyio.current_time())
            out.append(item)
            if isinstance(item, Failure) or item.finish_reason is not None:
                return

    for last in (Delta(rid=1, text="", token_ids=[3], finish_reason="stop"), Failure(RequestFailed("boom"))):
        send, recv = delta_stream()
        recv.wake_at_end()
        out: list = []
        woke.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, recv, out)
            for i in range(5):
                await anyio.sleep(0.01)
                send.send_nowait(Delta(rid=1, text="", token_ids=[i]))
            await anyio.sleep(0.01)
            assert out == []  # five deltas queued, the reader never woke
            send.send_nowait(last)
        assert [d.token_ids for d in out[:5]] == [[0], [1], [2], [3], [4]] and out[5] is last
        assert len(set(woke)) == 1  # all six taken in the one wake-up


def test_the_byte_detokenizer_ascii_fast_path_gives_the_incremental_decoders_text():
    """ASCII bytes skip the UTF-8 decoder only while it holds nothing: every
    segment equals the decoder's own, through split, invalid and lone bytes."""
    import codecs

    from engine.fake.tokenizer import ByteDetokenizer

    rng = random.Random(5)
    for _ in range(2000):
        picks = (
            lambda: rng.randrange(128),
            lambda: rng.randrange(128, 256),
            lambda: 256,
            lambda: rng.choice([0xC3, 0xE2, 0xF0, 0x82, 0xA9]),
        )
        tokens = [rng.choice(picks)() for _ in range(rng.randrange(1, 40))]
        detok, ref = ByteDetokenizer(), codecs.getincrementaldecoder("utf-8")(errors="replace")
        for t in tokens:
            detok.add_token(t)
            assert detok.last_segment == (ref.decode(bytes([t])) if t < 256 else ""), tokens
        detok.finalize()
        assert detok.last_segment == ref.decode(b"", final=True)
    for a in range(257):  # every byte after every byte (and EOS): held or not, replaced or not
        for b in range(257):
            detok, ref = ByteDetokenizer(), codecs.getincrementaldecoder("utf-8")(errors="replace")
            for t in (a, b):
                detok.add_token(t)
                assert detok.last_segment == (ref.decode(bytes([t])) if t < 256 else ""), (a, b)


def test_the_nucleus_is_the_stable_sorts_even_where_logits_tie():
    """_nucleus sorts with introsort and falls back to the stable sort where
    kept values tie: kept ids, cdf and total equal a stable sort's, for fake
    logits and for logits full of ties (rounded), at several temperatures and
    top-p values including 1."""
    import numpy as np

    from engine.fake.logits import fake_logits
    from engine.fake.sampling import _NUCLEI, _nucleus, _softmax

    def stable(logits, t, top_p):
        p = _softmax(logits, t)
        order = np.argsort(-p, kind="stable")
        cdf = np.cumsum(p[order])
        cut = min(int(np.searchsorted(cdf, top_p)) + 1, p.size) if top_p < 1.0 else p.size
        return order[:cut], cdf[:cut], float(cdf[cut - 1])

    rng = np.random.default_rng(1)
    cases = [fake_logits(0, h, ByteTokenizer.vocab_size) for h in range(300)]
    for i in range(300):
        tied = np.round(rng.standard_normal(260).astype(np.float32) * 3, i % 2).astype(np.float32)
        tied[257:] = -np.inf
        cases.append(tied)
    for logits in cases:
        for t, top_p in ((0.7, 0.95), (1.0, 0.5), (2.0, 0.99), (1.0, 1.0)):
            _NUCLEI.clear()
            got, want = _nucleus(logits, t, top_p), stable(logits, t, top_p)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


def test_fake_gpu_raw_state_setter_gives_the_state_property_s_draws():
    """``_generator_at`` writes the digest into PCG64's state in place where
    the layout checks out; the draws must be those of the ``state`` property."""
    import hashlib

    import numpy as np

    from engine.fake import logits as fg

    fg._generator_at(0, 0)
    ref = np.random.Generator(np.random.PCG64(0))
    for h in range(0, 300 * 7919, 7919):
        got = fg._generator_at(3, h)
        a, r = got.standard_normal(260, dtype=np.float32), got.random()
        ref.bit_generator.state = fg._state_dict(
            int.from_bytes(hashlib.blake2b(b"%d:%d" % (3, h), digest_size=32).digest(), "little")
        )
        assert np.array_equal(a, ref.standard_normal(260, dtype=np.float32)) and r == ref.random()

    # a generator whose layout is not the expected one gets no raw setter
    class Odd:
        bit_generator = None

    assert fg._raw_state_setter(Odd()) is None


def test_fake_logits_and_tokens_are_those_of_the_plain_formula():
    """The logits are drawn, scaled and offset in one vector add, greedy
    tokens skip the logits memo, and a sampled token's nucleus is cut among
    the likeliest ids and drawn by a bisect on Python lists: the values and
    the tokens must be those of the plain formula, the full stable sort and
    numpy's searchsorted, for several EOS biases and sampling settings."""
    import numpy as np

    from engine.fake import logits as fg
    from engine.fake import sampling as fs

    def plain_logits(seed, h, vocab, eos_bias):
        logits = fg._generator_at(seed, h).standard_normal(vocab, dtype=np.float32)
        logits *= 3.0
        logits[ByteTokenizer.EOS] += eos_bias - 4.0
        logits[ByteTokenizer.EOS + 1 :] = -np.inf
        return logits

    def plain_sample(logits, t, top_p, rng):
        p = fs._softmax(logits, t)
        order = np.argsort(-p, kind="stable")
        cdf = np.cumsum(p[order])
        cut = min(int(np.searchsorted(cdf, top_p)) + 1, p.size) if top_p < 1.0 else p.size
        i = int(cdf[:cut].searchsorted(rng.random() * float(cdf[cut - 1]), side="right"))
        return int(order[min(i, cut - 1)])

    for bias in (0.0, 1.5, -0.3, 0.1):
        for h in range(0, 400 * 7919, 7919):
            want = plain_logits(5, h, ByteTokenizer.vocab_size, bias)
            got = fg.fake_logits(5, h, ByteTokenizer.vocab_size, bias)
            assert np.array_equal(got, want) and not got.flags.writeable
            assert fg.greedy_token(5, h, ByteTokenizer.vocab_size, bias) == int(want.argmax())
    for t, top_p in ((0.7, 0.95), (1.0, 0.5), (2.0, 0.99), (1.0, 1.0), (0.3, 0.999999)):
        sp = SamplingParams(max_tokens=1, temperature=t, top_p=top_p)
        a, b = np.random.Generator(np.random.PCG64(9)), np.random.Generator(np.random.PCG64(9))
        for h in range(300):
            logits = fg.fake_logits(2, h * 31, ByteTokenizer.vocab_size)
            assert fs.sample_token(logits, sp, a) == plain_sample(logits, t, top_p, b)
