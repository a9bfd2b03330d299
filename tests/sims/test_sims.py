"""The deterministic simulator (sims.run): a small seed sweep of the CI
scenarios must pass, the digest must be reproducible, and each invariant
checker must catch the bug it exists for (a checker that cannot fail is no
check)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from engine.fake.disk import FaultyDisk
from engine.fake.gpu import FakeBackend, FakeGPUConfig, expected_tokens
from engine.types import SamplingParams
from sims import gen, sweep
from sims import invariants as inv
from sims import run as simrun
from sims.run import Simulation, run_scenario
from sims.scenarios import SCENARIOS, DiskFaults


def small(name: str, requests: int = 20, **kw) -> simrun.Scenario:
    base = SCENARIOS[name]
    make = {"agent": gen.agent, "chat": gen.chat}.get(name)
    if name in ("crash",):
        return dataclasses.replace(base, trace=lambda seed: gen.restart(seed, requests=requests), **kw)
    return dataclasses.replace(base, trace=lambda seed: make(seed, requests=requests), **kw)


def ran(result, name: str) -> inv.Checker:
    return next(c for c in result.checkers if c.name == name)


# ---------------------------------------------------------------------------
# The CI sweep and determinism.


@pytest.mark.parametrize(
    "name, seed",
    [("agent", 1), ("agent", 2), ("chat", 1), ("chat", 2), ("crash", 1), ("crash", 2), ("crash", 3), ("slow-disk", 1)],
)
def test_ci_scenarios_pass(name, seed):
    r = run_scenario(name, seed)
    assert r.ok, r.summary()
    assert r.counters["answered"] == r.counters["requests"]
    # the checkers that guard the tiers actually ran
    for checker in (
        "tokens-match-cold-prefill",
        "admission-never-waits",
        "liveness",
        "no-write-during-step",
        "spill-queue-bounded",
    ):
        assert ran(r, checker).ran and ran(r, checker).checked > 0, checker
    assert ran(r, "tokens-match-cold-prefill").with_cache > 0  # prefixes were restored, not only cold prefills
    assert r.summary().splitlines()[-1] == f"digest: {r.digest}"


def test_crash_scenario_injects_its_faults_and_checks_flushes():
    r = run_scenario("crash", 1)
    assert r.ok, r.summary()
    assert r.counters["power_losses"] >= 2 and r.counters["restarts"]["graceful"] >= 1
    assert r.counters["retries"] > 0
    assert ran(r, "flush-survives-crash").checked > 0


def test_admission_twin_compares_write_behind_on_and_off():
    r = run_scenario("admission", 0)
    assert r.ok, r.summary()
    assert any("twin run with write-behind off" in n and ", 0 differ" in n for n in r.notes)


def test_same_seed_same_digest_other_seed_other_digest():
    a = Simulation(small("crash"), 5).run()
    b = Simulation(small("crash"), 5).run()
    c = Simulation(small("crash"), 6).run()
    assert a.digest == b.digest and a.events == b.events
    assert c.digest != a.digest


@pytest.mark.slow  # subprocesses
def test_digest_does_not_depend_on_the_process_hash_seed():
    cmd = [sys.executable, "-m", "sims.run", "--scenario", "agent", "--seed", "3", "--trace", "agent-small"]
    digests = []
    for hashseed in ("1", "2"):
        out = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": hashseed}, timeout=120
        )
        assert out.returncode == 0, out.stdout + out.stderr
        digests.append(out.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1] and digests[0].startswith("digest: ")


# ---------------------------------------------------------------------------
# Each checker catches its bug.


def test_a_corrupted_restore_is_caught_by_the_cold_prefill_oracle():
    class BadRestore(FakeBackend):
        def step(self, plan):
            for o in plan.open:
                if o.cache is not None and o.cached > 8:
                    o.cache[-1].values[0, 0, o.cached - 1, 0] += 1.0  # a wrong KV value at the prefix's end
            return super().step(plan)

    r = Simulation(small("agent"), 1, backend=BadRestore).run()
    bad = ran(r, "tokens-match-cold-prefill").findings
    assert bad and "diverged at output token 0" in bad[0].message and not r.ok


def test_a_disk_that_lies_about_fsync_is_caught_after_the_crash(monkeypatch):
    monkeypatch.setattr(FaultyDisk, "fsync", lambda self, fh: None)
    r = Simulation(small("agent"), 1).run()
    bad = ran(r, "flush-survives-crash").findings
    assert bad and "answered durable" in bad[0].message


def test_a_write_gate_that_ignores_busy_is_caught():
    # slow writes (1 s per I/O call) are still being issued when agent turns arrive
    scenario = small("agent", 30, disk=DiskFaults(slow_io_prob=1.0, slow_io_s=1.0))
    r = Simulation(scenario, 1, gated_writes=False).run()  # the coordinator's writes skip the idle gate
    checker = ran(r, "no-write-during-step")
    assert checker.findings and checker.overlapped_steps > 0
    assert any("during GPU step" in f.message or "while a tensor write step" in f.message for f in checker.findings)


def test_a_request_that_never_finishes_is_a_liveness_finding():
    class Stuck(FakeBackend):
        def step(self, plan):
            if any(len(c.tokens) > 300 for c in plan.prefill) or self.steps > 40:
                raise MemoryError("fake GPU: out of memory forever")
            return super().step(plan)

    r = Simulation(small("agent", 6, drain_deadline_s=120.0), 1, backend=Stuck).run()
    live = ran(r, "liveness")
    assert any("not answered by the drain deadline" in f.message for f in live.findings)
    assert any("in the liveness phase" in f.message for f in live.findings)


def test_admission_checker_flags_a_late_admission_and_waiting_senders():
    class View:
        engine = None
        healed_at = None

    c = inv.AdmissionNeverWaits(View())
    ev = [
        ("sim_up", 0.0, {"gen": 1}),
        ("step", 0.0, {"n": 1}),
        ("sim_submit", 0.001, {"gen": 1, "rid": 7}),
        ("step_end", 0.01, {"n": 1}),
        ("admit", 0.01, {"rid": 7}),  # on time: at the end of the running step
        ("sim_submit", 0.02, {"gen": 1, "rid": 8}),
        ("admit", 0.05, {"rid": 8}),
    ]  # idle engine, 30 ms late
    for kind, t, f in ev:
        c.on_event(kind, t, f)
    assert c.checked == 2 and len(c.findings) == 1 and "rid=8" in c.findings[0].message
    c2 = inv.AdmissionNeverWaits(View())
    for kind, t, f in [("sim_up", 0.0, {"gen": 1}), ("sim_submit", 0.0, {"gen": 1, "rid": 1}), ("step", 0.0, {"n": 1})]:
        c2.on_event(kind, t, f)
    assert "a new GPU step began" in c2.findings[0].message


def test_admission_checker_sees_a_task_waiting_to_send_into_the_scheduler_inbox():
    import types

    import anyio

    from actors.runtime import ActorRef, inbox

    async def main():
        send, recv = inbox(1)
        ref = ActorRef("scheduler", send)
        ref.tell_nowait("full")  # the inbox's one place taken: the next tell waits

        class View:
            engine = types.SimpleNamespace(scheduler=types.SimpleNamespace(ref=ref))
            healed_at = None

        c = inv.AdmissionNeverWaits(View())
        c.on_event("sim_up", 0.0, {"gen": 1})
        async with anyio.create_task_group() as tg:
            tg.start_soon(ref.tell, "x")
            for _ in range(3):
                await anyio.sleep(0)
            c.on_event("step", 0.0, {"n": 1})  # the tell above waits for inbox space
            assert c._senders is not None  # read directly, not through statistics()
            assert (await recv.receive()).msg == "full"
            assert (await recv.receive()).msg == "x"
        c.on_event("step_end", 0.01, {"n": 1})  # nobody waits any more
        send.close()
        recv.close()
        return c

    c = anyio.run(main)
    assert c.waiters_seen == 1 and len(c.findings) == 1 and "1 task(s) waiting to send" in c.findings[0].message


def test_write_checker_flags_ungated_writes_and_steps_begun_while_busy():
    c = inv.NoWriteDuringStep()
    for kind, t, f in [
        ("step", 0.0, {"n": 1}),
        ("disk_write", 0.001, {"path": "/x"}),
        ("step_end", 0.01, {"n": 1}),
        ("step", 0.02, {"n": 2}),
        ("write_start", 0.03, {}),
        ("write_end", 0.035, {}),
        ("step_end", 0.04, {"n": 2}),
    ]:
        c.on_event(kind, t, f)
    assert [f.message.split(" ")[0] for f in c.findings] == ["disk_write", "write"]
    assert "outside any gated write step" in c.findings[0].message and "during GPU step 2" in c.findings[1].message


def test_recording_disk_folds_a_run_of_calls_into_one_record_the_write_checker_reads():
    from engine.eventlog import EventLog
    from sims.world import RecordingDisk

    class Clock:
        t = 0.0

        def now(self):
            return self.t

    log, clock = EventLog(), Clock()
    c = inv.NoWriteDuringStep()
    log.listeners.append(c.on_event)
    disk = RecordingDisk(FaultyDisk(), log, clock)
    disk.makedirs("/d")
    log.record("step", 0.0, n=1)
    fh = disk.open("/d/a", write=True)  # ungated: during step 1, outside any write step
    disk.write(fh, 0, b"xy")
    disk.fsync(fh)
    clock.t = 0.5
    log.record("step_end", 0.5, n=1)  # closes the run of calls: one record, before this one
    disk.close(fh)
    disk.rename("/d/a", "/d/b")
    kinds = [k for k, _, _ in log.records]
    assert kinds == ["step", "disk", "step_end"]  # the rename is still held
    assert log.of("disk")[-1][1]["ops"] == [["rename", "/d/a", "/d/b"]]  # reading the log records it
    assert log.records[1][2]["ops"] == [["open", "/d/a"], ["write", "/d/a", 0, 2], ["fsync", "/d/a"]]
    assert [f.message.split(" ")[0] for f in c.findings] == ["disk_write", "disk_fsync"] and c.checked == 2


@pytest.mark.slow  # a long scenario
def test_slow_disk_overlaps_in_flight_write_steps_without_stalling_admission():
    # 50 ms per I/O call: write steps are still in flight when turns arrive, the
    # GPU steps start anyway (admission on time) and no new write step begins.
    r = run_scenario("slow-disk", 2)
    assert r.ok, r.summary()
    w = ran(r, "no-write-during-step")
    assert w.overlapped_steps > 0 and w.overlap_io > 0
    assert ran(r, "admission-never-waits").checked == r.counters["requests"]


def test_write_checker_lets_the_in_flight_write_step_finish_under_a_new_gpu_step():
    # A write step begun while idle is overlapped by a request's GPU step: the step
    # must not wait for it (admission never waits), and its own I/O may land then.
    c = inv.NoWriteDuringStep()
    for kind, t, f in [
        ("write_start", 0.0, {}),
        ("step", 0.01, {"n": 1}),
        ("disk_write", 0.02, {"path": "/x"}),
        ("disk_fsync", 0.03, {"path": "/x"}),
        ("write_end", 0.04, {}),
        ("step_end", 0.05, {"n": 1}),
    ]:
        c.on_event(kind, t, f)
    assert not c.findings and c.overlapped_steps == 1 and c.overlap_io == 2
    c.on_event("step", 0.06, {"n": 2})
    c.on_event("write_start", 0.07, {})  # the next write step may not begin until the GPU step ends
    assert len(c.findings) == 1 and "began during GPU step 2" in c.findings[0].message


def test_spill_queue_checker_allows_cap_plus_one_item_only():
    from engine.kv.spill_queue import SpillItem, SpillQueue

    class Durability:
        def __init__(self, q):
            self.core = type("Core", (), {})()
            self.core.queue = q

    class View:
        healed_at = None

        def __init__(self, engine):
            self.engine = engine

    q = SpillQueue(cap_bytes=100)
    engine = type("E", (), {})()
    engine.durability = Durability(q)
    c = inv.SpillQueueBounded(View(engine))
    q.items += [SpillItem("", [1], None, 90), SpillItem("", [2], None, 60)]
    q.pending_bytes = 150  # cap + the newest item: allowed
    c.on_event("x", 0.0, {})
    assert c.ran and not c.findings
    q.items.append(SpillItem("", [3], None, 60))
    q.pending_bytes = 210
    c.on_event("x", 1.0, {})
    assert c.findings and "more than its cap 100" in c.findings[0].message


def test_oracle_matches_expected_tokens_and_seeded_sampling_is_reproducible():
    cfg = FakeGPUConfig(eos_bias=6.0)
    o = inv.Oracle(cfg)
    prompt = list(b"the oracle prompt")
    want = expected_tokens(prompt, 40, cfg)
    got, h = o.expect(prompt, SamplingParams(max_tokens=40))
    assert got == [t for t in want if t != 256] and len(got) < 40  # EOS ends it, as the engine does
    # continuing from the prompt's hash gives the same tokens as hashing from scratch
    more = prompt + got + list(b" next")
    assert (
        o.expect(more, SamplingParams(max_tokens=5), (o.extend(h, got), len(prompt) + len(got)))[0]
        == o.expect(more, SamplingParams(max_tokens=5))[0]
    )
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5)
    assert (
        o.expect(prompt, sp)[0]
        == o.expect(prompt, sp)[0]
        != o.expect(prompt, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=6))[0]
    )


# ---------------------------------------------------------------------------
# The command line.


@pytest.mark.slow  # whole scenarios
def test_list_and_violation_exit_code(monkeypatch, capsys):
    assert simrun.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("agent", "chat", "crash"):
        assert f"\n{name} " in "\n" + listed

    class BadRestore(FakeBackend):
        def step(self, plan):
            for o in plan.open:
                if o.cache is not None and o.cached > 8:
                    o.cache[-1].values[0, 0, o.cached - 1, 0] += 1.0
            return super().step(plan)

    monkeypatch.setattr(simrun, "fake_backend", BadRestore)  # the CLI's simulation makes its GPUs with it
    assert simrun.main(["--scenario", "agent", "--seed", "4", "--trace", "agent-small"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "reproduce: python -m sims.run --scenario agent --seed 4" in out
    assert any(line.startswith("VIOLATION [tokens-match-cold-prefill]") for line in out)
    assert out[-1].startswith("digest: ")
    assert simrun.main(["--scenario", "chat-10k", "--seed", "2", "--chat-requests", "40"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "reproduce: python -m sims.run --scenario chat-10k --seed 2 --chat-requests 40" in out
    assert "trace: chat (40 requests, " in out[0]


@pytest.mark.slow  # many simulations
def test_sweep_seed_ranges_and_one_run(capsys):
    assert sweep.parse_seeds("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    with pytest.raises(Exception, match="bad seed range"):
        sweep.parse_seeds("a-b")
    o = sweep.run_one("agent", 2, twice=True)
    assert o.ok and o.reproduce == "python -m sims.run --scenario agent --seed 2"


# ---------------------------------------------------------------------------
# Live replay against `ember serve --fake-gpu` (127.0.0.1, a few seconds).


@pytest.mark.slow  # a live server, restarted
def test_replay_against_ember_serve_with_a_crash_and_a_flush(tmp_path, capsys):
    from sims.live import replay
    from sims.trace import Flush, Header, Request, Restart, Trace

    turn = "<|system|>" + "You are a coding agent. " * 20
    events = [
        Request(id=0, t=0.0, session="a", text=turn + "<|user|>first", max_tokens=8),
        Request(id=1, t=0.5, session="b", text=turn + "<|user|>other", max_tokens=8),
        Request(id=2, t=1.0, session="a", continues="a", text="<|tool|>ok", max_tokens=8),
        Flush(t=1.5),
        Restart(t=2.0, crash=True, down_s=0.5),
        Request(id=3, t=2.2, session="a", continues="a", text="<|tool|>after the crash", max_tokens=8),
        Request(id=4, t=2.4, session="c", tokens=list(b"token ids work too"), max_tokens=4),
    ]
    path = tmp_path / "t.ndjson"
    Trace(Header(kind="test"), events).write(path)
    out = tmp_path / "out"
    cmd = f"{sys.executable} -m transport.cli serve --fake-gpu --port {{port}} --log-level warning --ssd-cache {tmp_path / 'ssd'}"
    rc = replay.main(["--server-cmd", cmd, "--trace", str(path), "--out", str(out), "--time-scale", "1.0"])
    report = capsys.readouterr().out
    assert rc == 0, report + (out / "server.log").read_text()
    assert "answered: 5 of 5, failed 0" in report
    assert "| TTFT |" in report and "| inter-token |" in report
    assert "| crash | exit status -9" in report and "| flush | HTTP 200, durable=True" in report
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = [json.loads(line) for line in (out / "samples.ndjson").read_text().splitlines()]
    assert [s["id"] for s in samples] == [0, 1, 2, 3, 4] and all(s["ok"] and s["ttft_s"] > 0 for s in samples)
    # the continuation after the crash found its prefix again (restored from the SSD tier)
    assert samples[3]["cached_tokens"] > len(turn)


def test_replay_report_math():
    from sims.live.replay import Mark, Sample
    from sims.live.replay_report import pct, report_markdown, summarize
    from sims.trace import Header, Trace

    assert pct([], 50) is None and pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    a = Sample(
        id=0,
        session="a",
        start=0.0,
        end=2.0,
        ttft_s=0.1,
        itl_s=[0.01, 0.03],
        completion_tokens=10,
        prompt_tokens=100,
        cached_tokens=80,
        ok=True,
        attempts=1,
    )
    b = Sample(
        id=1, session="b", start=1.0, end=4.0, errors=["HTTP 503: draining", "ConnectError: refused"], attempts=2
    )
    m = summarize([a, b])
    assert m["ok"] == 1 and m["failed"] == 1 and m["errors"] == {"HTTP 503": 1, "ConnectError": 1}
    assert m["span_s"] == 4.0 and m["tokens_per_s"] == 2.5 and m["cached_ratio"] == 0.8
    text = report_markdown(
        "http://x", Trace(Header(kind="k")), 1.0, [a, b], [Mark(1.5, "crash", "exit status -9")], None
    )
    assert "| 1.5 | crash | exit status -9 |" in text and "80.0% (80 of 100" in text
