"""bench.cpu.step_breakdown's measurement loop (no model: parts are fake callables
with known costs, so the test is deterministic)."""

from __future__ import annotations

import bench.cpu.step_breakdown as sb

NAMES = ["ember_step", "batchgen_next", "forward", "body", "head", "linears", "linears_fused", "sdpa", "sample"]


def test_medians_per_part_alternating_order_and_other_is_body_minus_linears_and_sdpa(monkeypatch) -> None:
    clock = {"t": 0.0}
    calls: list[str] = []
    cost = {name: 0.001 * (i + 1) for i, name in enumerate(NAMES)}

    def part(name: str):
        def run() -> None:
            calls.append(name)
            clock["t"] += cost[name]

        return run

    monkeypatch.setattr(sb.time, "perf_counter", lambda: clock["t"])
    fns = {name: part(name) for name in NAMES}
    out = sb.measure(fns, rounds=2, steps=3)
    for name in NAMES:
        assert abs(out[name] - cost[name] * 1e3) < 1e-9
    assert abs(out["other"] - (out["body"] - out["linears"] - out["sdpa"])) < 1e-9
    timed = calls[len(NAMES) :]  # after one warm-up call of each part
    assert timed[:3] == [NAMES[-1]] * 3  # round 0 runs the parts in reverse order
    assert timed[3 * len(NAMES) : 3 * len(NAMES) + 3] == [NAMES[0]] * 3  # round 1 in order
