"""Time to ready: Ember with its CPU calibration cached vs re-measured
(``EMBER_CPU_RECALIBRATE=1``), next to ``mlx_lm.server``, on the same model.

    python -m bench.serve.startup --model smollm2-135m --rounds 3

Each round starts the three one after the other (order rotating), each until
its HTTP port answers, then stops it; medians. The first Ember start may
measure (and write the cache) if no entry exists yet: it is a warm-up, not
counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.serve.vs_mlx_lm import Server, free_port


def main(argv: list[str] | None = None) -> int:
    from engine.models import resolve_model

    ap = argparse.ArgumentParser(prog="python -m bench.serve.startup")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    model = str(resolve_model(args.model))
    work = Path(tempfile.mkdtemp(prefix="ember-startup-"))

    def ember(env: dict[str, str]) -> Server:
        p = free_port()
        argv = [sys.executable, "-m", "transport.cli", "serve", "--model", model, "--port", str(p)]
        return Server("ember", argv, p, work / "ember.log", env=env)

    def mlxlm() -> Server:
        p = free_port()
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(p)]
        return Server("mlx-lm", argv, p, work / "m.log")

    kinds = {
        "ember (calibration cached)": lambda: ember({}),
        "ember (re-measured)": lambda: ember({"EMBER_CPU_RECALIBRATE": "1"}),
        "mlx_lm.server": mlxlm,
    }
    warm = kinds["ember (calibration cached)"]()
    warm.start(600)
    warm.stop()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    loads = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        names = list(kinds)
        for name in names[rnd % 3 :] + names[: rnd % 3]:
            srv = kinds[name]()
            times[name].append(srv.start(600))
            srv.stop()
            print(f"[startup] round {rnd + 1} {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
    print(f"Command: `python -m bench.serve.startup --model {args.model} --rounds {args.rounds}`")
    print(f"1-minute load average per round: {', '.join(f'{x:.1f}' for x in loads)}")
    print("| server | ready, s (median) | all rounds |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.1f} | {', '.join(f'{t:.1f}' for t in ts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
