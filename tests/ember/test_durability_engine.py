"""Write-behind, flush and shutdown through the whole engine on the fake GPU,
in virtual time, with the SSD tier on a real temporary directory."""

from __future__ import annotations

import logging
import random
import signal
import time

import anyio
import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.eventlog import EventLog
from engine.fake.gpu import FakeBackend, expected_tokens
from engine.ports import InlineDevice, LoopClock

pytestmark = pytest.mark.anyio


def fake(tmp_path, **kw) -> EngineConfig:
    return EngineConfig(backend="fake", max_batch=4, max_queue=256, prefill_chunk=64, ssd_cache_dir=str(tmp_path), **kw)


def overlaps(log: EventLog) -> tuple[list[str], int, int]:
    """Walk the event log in order: a write step (write_start..write_end) must
    never be open while a GPU step (step..step_end) is, nor the reverse."""
    in_step = in_write = False
    bad: list[str] = []
    steps = writes = 0
    for kind, t, f in log.records:
        if kind == "step":
            steps += 1
            if in_write:
                bad.append(f"step {f['n']} began at {t} inside a tensor write")
            in_step = True
        elif kind == "step_end":
            in_step = False
        elif kind == "write_start":
            writes += 1
            if in_step:
                bad.append(f"tensor write of item {f['seq']} began at {t} inside a GPU step")
            in_write = True
        elif kind == "write_end":
            in_write = False
    return bad, steps, writes


async def seeded_workload(
    tmp_path, seed: int, *, writebehind: bool, n: int = 40
) -> tuple[EventLog, dict[int, list[int]], list[int]]:
    """Bursts of requests with idle gaps (so write-behind runs) and arrivals
    that keep coming while snapshots are written."""
    rng = random.Random(seed)
    log = EventLog()
    waits: list[int] = []

    got: dict[int, list[int]] = {}
    async with Engine.open(fake(tmp_path, writebehind=writebehind), events=log) as engine:
        # Property 3, sampled at every admission: nothing waits on the Scheduler's inbox.
        log.listeners.append(
            lambda kind, t, f: (
                waits.append(engine.scheduler.ref.statistics().tasks_waiting_send) if kind == "admit" else None
            )
        )

        async def client(i: int, at: float, prompt: list[int], max_tokens: int) -> None:
            await anyio.sleep(at)
            c = await engine.acomplete(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            got[i] = c.token_ids
            assert c.token_ids == expected_tokens(prompt, max_tokens, stop_at_eos=False)

        async def flusher(every_s: float) -> None:
            # Forced flushes in the middle of traffic: their snapshots are taken
            # while busy, so only the idle gate keeps the tensor writes out of steps.
            while len(got) < n:
                await anyio.sleep(every_s)
                await engine.aflush()

        async with anyio.create_task_group() as tg:
            t = 0.0
            for i in range(n):
                # mostly close arrivals, sometimes a pause longer than the debounce
                t += rng.choice([rng.expovariate(30.0), rng.uniform(1.0, 2.5)])
                prompt = [rng.randrange(256) for _ in range(rng.randint(50, 400))]
                tg.start_soon(client, i, t, prompt, rng.randint(1, 30))
            tg.start_soon(flusher, 0.7)
        report = await engine.aflush()
        assert report.durable
    return log, got, waits


@pytest.mark.slow  # a long write-behind run
async def test_no_tensor_write_step_overlaps_a_gpu_step(tmp_path):
    for seed in (1, 2):
        log, got, _ = await seeded_workload(tmp_path / str(seed), seed, writebehind=True)
        bad, steps, writes = overlaps(log)
        assert len(got) == 40
        # both really happened (a write step per entry at least: tensors join
        # one step while the engine stays idle), interleaved
        assert steps > 100 and writes >= 40, (steps, writes)
        step_ts = [t for t, _ in log.of("step")]
        assert sum(step_ts[0] < t < step_ts[-1] for t, _ in log.of("write_start")) > 20
        assert bad == []


async def test_admission_times_are_identical_with_write_behind_on_and_off(tmp_path):
    on_log, on_got, on_waits = await seeded_workload(tmp_path / "on", 7, writebehind=True)
    off_log, off_got, off_waits = await seeded_workload(tmp_path / "off", 7, writebehind=False)
    assert on_got == off_got
    on_admits = [(f["rid"], t) for t, f in on_log.of("admit")]
    off_admits = [(f["rid"], t) for t, f in off_log.of("admit")]
    assert len(on_admits) == 40 and on_admits == off_admits
    # snapshots were really taken while requests kept arriving
    writes = [t for t, _ in on_log.of("write_start")]
    assert writes and min(writes) < max(t for _, t in on_admits)
    assert off_log.of("write_start") == []
    assert set(on_waits) == {0} and set(off_waits) == {0} and len(on_waits) == 40


async def test_close_right_after_a_request_then_reopen_restores_the_exact_prefix(tmp_path):
    prompt = list(b"The restart must not outrun the write-behind. " * 6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    async with Engine.open(fake(tmp_path)) as engine:
        first = await engine.acomplete(prompt, params)
        # closed at once: the snapshot is still debouncing
        assert engine.durability.core.stats()["pending_snapshots"] == 1
    assert engine.last_flush is not None and engine.last_flush.durable and engine.last_flush.flushed == 1
    assert not engine.shutdown_timed_out

    log = EventLog()
    async with Engine.open(fake(tmp_path), events=log) as engine:
        again = await engine.acomplete(prompt, params)
        assert engine.stats()["ssd_cache"]["restores"] == 1
    assert again.usage is not None and again.usage.cached_tokens >= len(prompt) - 1
    assert again.token_ids == first.token_ids == expected_tokens(prompt, 12, stop_at_eos=False)
    assert log.of("restored")


async def test_without_write_behind_a_restart_restores_nothing(tmp_path):
    """The control for the test above: the flush, not luck, made it durable."""
    prompt = list(b"no write-behind, no restore. " * 6)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    async with Engine.open(fake(tmp_path, writebehind=False)) as engine:
        await engine.acomplete(prompt, params)
    assert engine.last_flush is not None and engine.last_flush.durable and engine.last_flush.flushed == 0
    async with Engine.open(fake(tmp_path)) as engine:
        again = await engine.acomplete(prompt, params)
    assert again.usage is not None and again.usage.cached_tokens == 0
    assert again.token_ids == expected_tokens(prompt, 8, stop_at_eos=False)


async def test_aflush_reports_evidence_and_stats_carry_the_counters(tmp_path):
    async with Engine.open(fake(tmp_path)) as engine:
        for text in (b"first conversation " * 5, b"other conversation " * 5):
            await engine.acomplete(list(text), SamplingParams(max_tokens=4, ignore_eos=True))
        ssd = engine.stats()["ssd_cache"]
        assert ssd["pending_snapshots"] == 2 and ssd["pending_spills"] == 0
        report = await engine.aflush()
        assert report.durable and report.flushed == 2 and report.missing == 0
        assert report.pending_snapshots == report.pending_spills == report.pending_spill_bytes == 0
        assert report.entries == 2 and report.longest_durable_prefix_tokens == len(b"first conversation " * 5) + 3
        ssd = engine.stats()["ssd_cache"]
        for k in (
            "pending_snapshots",
            "pending_spills",
            "pending_spill_bytes",
            "dropped_spills",
            "failed_spills",
            "longest_durable_prefix_tokens",
        ):
            assert k in ssd
        assert ssd["pending_snapshots"] == 0 and ssd["entries"] == 2
        # nothing dirty: a second flush is durable at once and flushes nothing
        again = await engine.aflush()
        assert again.durable and again.flushed == 0 and again.elapsed_ms == 0.0


async def test_without_an_ssd_tier_flush_is_an_empty_durable_result():
    async with Engine.open(EngineConfig(backend="fake")) as engine:
        await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=2))
        report = await engine.aflush()
    assert report.durable and report.flushed == 0 and report.entries == 0


async def test_flush_during_a_long_request_waits_for_idle_and_never_delays_it(tmp_path):
    log = EventLog()
    async with Engine.open(fake(tmp_path), events=log) as engine:
        await engine.acomplete(list(b"a finished prefix " * 8), SamplingParams(max_tokens=4, ignore_eos=True))
        async with await engine.asubmit(list(b"a long one"), SamplingParams(max_tokens=300, ignore_eos=True)) as long:
            await long.__anext__()
            t0 = anyio.current_time()
            report = await engine.aflush()  # forced snapshot now; the tensor writes wait for idle
            t_flush = anyio.current_time()
            rest = [d async for d in long]
        assert rest[-1].finish_reason == "length"
        assert report.durable
        finish_t = log.of("finish")[-1][0]
        first_write = log.of("write_start")[0][0]
        assert first_write >= finish_t  # not one tensor while the long request ran
        assert t_flush > t0
    bad, _, writes = overlaps(log)
    assert bad == [] and writes > 0


async def test_shutdown_deadline_logs_the_pending_counters(tmp_path, caplog):
    cfg = fake(tmp_path, shutdown_timeout_s=2.0)
    with caplog.at_level(logging.ERROR, logger="ember.engine"):
        async with Engine.open(cfg) as engine:
            await engine.acomplete(list(b"dirty prefix " * 4), SamplingParams(max_tokens=2))
            stuck = await engine.asubmit([1, 2], SamplingParams(max_tokens=30_000, ignore_eos=True))
            await stuck.__anext__()  # still running when the engine closes: the drain cannot finish
        await stuck.aclose()
    assert engine.shutdown_timed_out
    assert "deadline" in caplog.text and "pending_snapshots=1" in caplog.text


async def test_shutdown_timeout_env_overrides_and_bad_values_fall_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EMBER_SHUTDOWN_TIMEOUT_S", "3")
    async with Engine.open(fake(tmp_path)) as engine:
        assert engine.shutdown_timeout_s == 3.0
    monkeypatch.setenv("EMBER_SHUTDOWN_TIMEOUT_S", "abc")
    with caplog.at_level(logging.WARNING, logger="ember.engine"):  # assemble.py logs it
        async with Engine.open(fake(tmp_path)) as engine:
            assert engine.shutdown_timeout_s == 120.0
    assert "EMBER_SHUTDOWN_TIMEOUT_S" in caplog.text


async def test_evictions_go_through_the_spill_queue_and_survive_a_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_SSD_WRITEBEHIND", "0")  # only evictions write
    entry = 2 * 2 * 4 * 4 * 2  # layers * heads * head_dim * float32 * (k, v) bytes per token
    cfg = fake(tmp_path, prompt_cache_gib=200 * entry / (1 << 30))  # room for one entry, not two
    a, b = list(b"evicted first " * 10), list(b"then this one " * 10)
    async with Engine.open(cfg) as engine:
        assert engine.durability.core.settings.writebehind is False
        await engine.acomplete(a, SamplingParams(max_tokens=4, ignore_eos=True))
        await engine.acomplete(b, SamplingParams(max_tokens=4, ignore_eos=True))  # evicts a
        report = await engine.aflush()
        assert report.durable and report.flushed == 0
        assert engine.durability.core.queue.stored >= 1
    monkeypatch.delenv("EMBER_SSD_WRITEBEHIND")
    async with Engine.open(fake(tmp_path)) as engine:
        again = await engine.acomplete(a, SamplingParams(max_tokens=4, ignore_eos=True))
    assert again.usage is not None and again.usage.cached_tokens >= len(a) - 1
    assert again.token_ids == expected_tokens(a, 4, stop_at_eos=False)


async def test_http_flush_route_answers_200_only_when_durable(tmp_path, monkeypatch):
    import httpx

    from actors.cold_tier import ColdTierPort
    from transport.server.http import build_app

    app = build_app(fake(tmp_path))
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            r = await client.post("/v1/completions", json={"prompt": "persist me please " * 4, "max_tokens": 3})
            assert r.status_code == 200
            r = await client.post("/admin/cache/flush", json={})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["durable"] is True and body["flushed"] == 1 and body["entries"] == 1
            assert body["longest_durable_prefix_tokens"] > len("persist me please " * 4)
            assert set(body) == {
                "durable",
                "flushed",
                "missing",
                "pending_snapshots",
                "pending_spills",
                "pending_spill_bytes",
                "dropped_spills",
                "failed_spills",
                "elapsed_ms",
                "entries",
                "longest_durable_prefix_tokens",
            }

            async def refuse(self, ns, tokens, cache, wait_turn) -> bool:
                return False  # the disk refused the write (full, or an I/O error)

            monkeypatch.setattr(ColdTierPort, "store", refuse)
            await client.post("/v1/completions", json={"prompt": "this one will not land " * 4, "max_tokens": 3})
            r = await client.post("/admin/cache/flush", json={})
            assert r.status_code == 503
            body = r.json()
            assert body["durable"] is False and body["pending_snapshots"] == 1 and body["failed_spills"] == 1
            stats = (await client.get("/stats")).json()["ssd_cache"]
            assert stats["pending_snapshots"] == 1 and stats["failed_spills"] == 1


async def test_http_flush_route_with_the_default_model_unloaded_answers_its_unloads_flush(tmp_path):
    """The registry may unload ``--model``; its unload drained and flushed it, and nothing
    has run on it since, so that flush's report is the route's answer (and nothing loads)."""
    import httpx

    from transport.server.http import build_app

    app = build_app(fake(tmp_path))
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            r = await client.post("/v1/completions", json={"prompt": "persist me please " * 4, "max_tokens": 3})
            assert r.status_code == 200
            r = await client.post("/admin/models/fake-gpu-0/unload", json={})
            assert r.status_code == 200 and r.json()["unloaded"] is True
            r = await client.post("/admin/cache/flush", json={})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["durable"] is True and body["flushed"] == 1 and body["entries"] == 1
            assert app.state.ember.registry.entries["fake-gpu-0"].state == "available"


# ---------------------------------------------------------------------------
# Real processes: `ember serve --fake-gpu --ssd-cache DIR`, signals, restarts.


@pytest.mark.slow
def test_sigterm_on_an_idle_server_with_a_snapshot_debouncing_keeps_the_prefix(tmp_path):
    from engine.fake.tokenizer import ByteTokenizer
    from sims.live.crashtest import start_server

    prompt = [ord(c) for c in "an idle server gets SIGTERM right after this request. " * 8]
    server = start_server(tmp_path / "ssd", tmp_path / "first.log")
    try:
        first = server.complete(prompt, 6)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        rc = server.terminate()  # at once: the write-behind is still in its 1 s debounce
    log = (tmp_path / "first.log").read_text()
    assert rc == 0, log
    assert "flush done durable=True flushed=1" in log

    server = start_server(tmp_path / "ssd", tmp_path / "second.log")
    try:
        again = server.complete(prompt, 6)
    finally:
        assert server.terminate() == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
    want = ByteTokenizer().decode(expected_tokens(prompt, 6))
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == want


@pytest.mark.slow
def test_serve_exits_1_when_the_shutdown_deadline_passes(tmp_path):
    import threading

    from sims.live.crashtest import start_server

    server = start_server(tmp_path / "ssd", tmp_path / "serve.log", env={"EMBER_SHUTDOWN_TIMEOUT_S": "1"})
    # a request far longer than the deadline keeps the drain from finishing
    t = threading.Thread(target=lambda: _ignore(server.complete, [65] * 10, 30_000), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while _in_flight(server) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    # draining, still listening: health and new requests answer 503
    assert _get_status(server.url + "/health") == 503
    status, _ = server.post("/v1/completions", {"prompt": "too late", "max_tokens": 1})
    assert status == 503
    rc = server.proc.wait(60)
    t.join(5)
    log = (tmp_path / "serve.log").read_text()
    assert rc == 1, log
    assert "deadline" in log and "pending_snapshots=" in log


@pytest.mark.slow
@pytest.mark.heavy  # five SIGKILLed servers in a row
def test_crashtest_reduced_five_kills(tmp_path):
    from sims.live.crashtest import run

    res = run(kills=5, seed=11, workdir=tmp_path, verbose=False)
    assert res.failures == []
    assert res.kills == 5 and res.restarts == 5 and res.restores_checked >= 3


def _ignore(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the server shuts down under it
        pass


def _get_status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _in_flight(server) -> int:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/stats", timeout=5) as r:
            return json.loads(r.read())["gateway"]["in_flight"]
    except Exception:  # noqa: BLE001 - not ready yet
        return 0


def test_the_sync_facade_flushes_too(tmp_path):
    engine = Engine.start(fake(tmp_path))
    try:
        engine.complete(list(b"sync callers get the boundary too " * 3), SamplingParams(max_tokens=3))
        report = engine.flush()
        assert report.durable and report.flushed == 1 and report.entries == 1
    finally:
        engine.stop()
    assert engine.last_flush is not None and engine.last_flush.durable and engine.last_flush.flushed == 0


class YieldingDevice(InlineDevice):
    """Every call takes a little time, even a step that only closes rows — as on
    the MLX thread, where the loop runs other tasks while the device works."""

    async def run(self, fn, *args, cost_s: float = 0.0):
        await self.clock.sleep(max(cost_s, 0.001))
        return fn(*args)


async def test_a_flush_right_after_a_completion_covers_it(tmp_path):
    """The RAM put happens at the step that closes the row, after the caller saw
    the last token; the flush settles with the Scheduler first."""
    clock = LoopClock()
    cfg = fake(tmp_path)
    async with Engine.open(cfg, backend=FakeBackend(cfg.fake), device=YieldingDevice(clock), clock=clock) as engine:
        for i in range(3):
            prompt = list(f"flush me at once, number {i}. ".encode() * 4)
            await engine.acomplete(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
            report = await engine.aflush()
            assert report.durable and report.flushed == 1, report
            assert report.entries == i + 1
