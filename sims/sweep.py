"""Seed sweep: many (scenario, seed) simulations, each in a worker process.

    python -m sims.sweep --seeds 0-199
    python -m sims.sweep --seeds 0-19 --scenarios crash --jobs 2 --twice

Prints one line per scenario (runs, failures, time) and, for every failing
run, its first findings and the command that reproduces it; exits 1 if any
run failed. A progress bar shows on a terminal only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from sims.scenarios import SCENARIOS

DEFAULT_SCENARIOS = ("agent", "chat", "crash", "gpu", "admission")


def parse_seeds(spec: str) -> list[int]:
    """``"0-199"``, ``"7"``, ``"1,4,9-12"`` → a sorted list of seeds."""
    seeds: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad seed range {part!r} (use 0-199 or 1,4,9-12)") from None
        if b < a:
            raise argparse.ArgumentTypeError(f"empty seed range {part!r}")
        seeds.update(range(a, b + 1))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds")
    return sorted(seeds)


@dataclass(frozen=True)
class Outcome:
    scenario: str
    seed: int
    ok: bool
    digest: str
    findings: tuple[str, ...]
    wall_s: float
    virtual_s: float
    reproduce: str


def run_one(scenario: str, seed: int, twice: bool) -> Outcome:
    import logging

    from sims.run import run_scenario

    logging.getLogger("ember").setLevel(logging.CRITICAL)  # the findings say what matters
    r = run_scenario(scenario, seed)
    findings = [str(f) for f in r.findings]
    if twice:
        again = run_scenario(scenario, seed)
        if again.digest != r.digest:
            findings.append(f"[determinism] digest {r.digest} then {again.digest}")
    return Outcome(scenario, seed, not findings, r.digest, tuple(findings[:3]), r.wall_s, r.virtual_s, r.reproduce())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sims.sweep", description="Run many seeds of the simulation scenarios.")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-19"), help="e.g. 0-199 or 1,4,9-12")
    ap.add_argument(
        "--scenarios", default=",".join(DEFAULT_SCENARIOS), help="comma-separated (see python -m sims.run --list)"
    )
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="worker processes")
    ap.add_argument("--twice", action="store_true", help="run every seed twice and compare digests")
    args = ap.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; python -m sims.run --list shows them", file=sys.stderr)
        return 2
    jobs = [(s, seed) for s in names for seed in args.seeds]
    show = sys.stderr.isatty()
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), unit="run", desc="sweep")
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, s, seed, args.twice) for s, seed in jobs]
        for fut in as_completed(futures):
            o = fut.result()
            outcomes.append(o)
            if not o.ok:  # at once, so a long sweep that is cut short still says what failed
                line = f"FAIL {o.reproduce}: {o.findings[0] if o.findings else ''}"
                if bar is not None:
                    bar.write(line)
                else:
                    print(line, flush=True)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    outcomes.sort(key=lambda o: (names.index(o.scenario), o.seed))
    print(
        f"sweep: {len(jobs)} runs ({len(names)} scenarios x {len(args.seeds)} seeds{', each twice' if args.twice else ''}) in {wall:.1f} s wall, {args.jobs} jobs"
    )
    for name in names:
        mine = [o for o in outcomes if o.scenario == name]
        bad = [o for o in mine if not o.ok]
        virt = sum(o.virtual_s for o in mine)
        cpu = sum(o.wall_s for o in mine)
        print(f"  {name:10s} runs {len(mine):4d}  failed {len(bad):3d}  virtual {virt:9.0f} s  run time {cpu:7.1f} s")
    failed = [o for o in outcomes if not o.ok]
    for o in failed:
        print(f"FAIL {o.scenario} seed {o.seed}:")
        for f in o.findings:
            print(f"    {f}")
        print(f"    reproduce: {o.reproduce}")
    print("result: " + ("all passed" if not failed else f"{len(failed)} of {len(outcomes)} runs failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
