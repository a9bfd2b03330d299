"""Where a streamed token's CPU goes, per server thread, side by side:

    python -m bench.cpu.cpu_per_token                        # 1 and 8 streams, Ember and the bare server
    python -m bench.cpu.cpu_per_token --streams 8 --rounds 12 --servers ember,bare,mlx-lm

Starts each server (Ember, ``bench/serve/bare_server.py``, optionally
``mlx_lm.server``) on the bundled model, alternates them round by round, and
drives each round with ``--streams`` concurrent streaming requests through the
same httpx client as ``bench.serve.vs_mlx_lm``. Around every round it reads each server
thread's CPU time from ``/proc/PID/task/*/stat`` (Linux), and its own with
``time.process_time``, and reports CPU milliseconds per generated token by
thread: the event loop (the process's main thread), Ember's MLX thread (named
``ember-mlx`` in the OS: it builds each step's graph and waits for it), and the
rest (MLX's own stream thread that runs the kernels, OpenBLAS workers, the
bare server's generation thread). On a machine whose cores the
decode already fills, CPU that one side spends beyond the other is what its
tokens wait for; this is the profile behind the "Ember / bare loop" ratio of
docs/bench/vs-mlx-lm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve import vs_mlx_lm as bench
from bench.serve.vs_mlx_lm import Prompts, Server, free_port, stream_completion

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of ``pid``: "main", "ember-mlx" or "other".

    Linux threads inherit their creator's name, so MLX's stream thread and the
    OpenBLAS workers it starts are called ``ember-mlx`` too; the MLX thread
    itself is the first of that name (thread ids grow)."""
    named: list[tuple[int, str, float]] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended between listdir and open
            continue
        named.append((int(tid), name, (int(fields[11]) + int(fields[12])) / TICK))  # utime + stime
    mlx = min((tid for tid, name, _ in named if name == "ember-mlx"), default=None)
    out = {"main": 0.0, "ember-mlx": 0.0}
    for thread, _, cpu in named:
        if thread == pid:
            out["main"] += cpu
        elif thread == mlx:
            out["ember-mlx"] += cpu
    # The rest from the process's total, which keeps the time of threads that
    # have ended (the bare server starts a generation thread per request).
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["other"] = (int(fields[11]) + int(fields[12])) / TICK - out["main"] - out["ember-mlx"]
    return out


async def one_round(client: httpx.AsyncClient, srv: Server, prompts: Prompts, streams: int, tokens: int, offset: int):
    assert srv.proc is not None, "the server is started"
    pid = srv.proc.pid
    before, c0, t0 = thread_cpu(pid), time.process_time(), time.perf_counter()
    samples = await asyncio.gather(
        *[stream_completion(client, srv.url, prompts.of(48, offset=offset + 500 * i), tokens) for i in range(streams)]
    )
    wall, client_cpu, after = time.perf_counter() - t0, time.process_time() - c0, thread_cpu(pid)
    n = sum(s.completion_tokens for s in samples)
    per_thread = {k: (after[k] - before.get(k, 0.0)) * 1000 / n for k in after}
    return n / wall, per_thread, client_cpu * 1000 / n


def servers(names: list[str], model_dir: Path, work: Path, bare_blas_threads: int) -> list[Server]:
    py = sys.executable
    argv = {
        "ember": [py, "-m", "transport.cli", "serve", "--model", str(model_dir)],
        "bare": [py, "-m", "bench.serve.bare_server", "--model", str(model_dir)],
        "mlx-lm": [py, "-m", "mlx_lm.server", "--model", str(model_dir)],
    }
    out = []
    for name in names:
        port = free_port()
        env = {"OPENBLAS_NUM_THREADS": str(bare_blas_threads)} if name == "bare" and bare_blas_threads else {}
        out.append(Server(name, argv[name] + ["--port", str(port)], port, work / f"{name}.log", env=env))
    return out


async def run(args: argparse.Namespace) -> str:
    from engine.models import resolve_model

    model_dir = resolve_model(args.model)
    bench.MODEL_NAME = str(model_dir)  # both real servers serve the model under its directory
    prompts = Prompts(model_dir)
    work = Path(tempfile.mkdtemp(prefix="ember-cpu-"))
    srvs = servers(args.servers.split(","), model_dir, work, args.bare_blas_threads)
    results: dict[tuple[int, str], list[tuple[float, dict[str, float], float]]] = {}
    try:
        for s in srvs:
            s.start()
        async with httpx.AsyncClient() as client:
            for s in srvs:  # first-call costs stay out of the numbers
                await one_round(client, s, prompts, 2, 8, offset=100)
            offset = 20000
            for streams in args.streams:
                tokens = args.tokens if streams > 1 else args.tokens_single
                for r in range(args.rounds):
                    order = srvs if r % 2 == 0 else srvs[::-1]
                    for s in order:
                        offset += 7  # fresh prompts: no prefix-cache hits
                        results.setdefault((streams, s.name), []).append(
                            await one_round(client, s, prompts, streams, tokens, offset)
                        )
                    print(
                        f"[cpu_per_token] {streams} streams: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True
                    )
    finally:
        for s in srvs:
            s.stop()
    return report(results, args)


def report(results: dict, args: argparse.Namespace) -> str:
    cols = ["main", "ember-mlx", "other"]
    lines = [
        f"Command: `python -m bench.cpu.cpu_per_token {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"Load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}. Medians over "
        f"{args.rounds} alternating rounds; CPU ms per generated token.",
        "",
        "| streams | server | tok/s | event loop (main thread) | MLX thread (`ember-mlx`) | other threads "
        "(MLX stream, BLAS, generation) | server total | client (this process) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (streams, name), rows in results.items():
        med = {c: statistics.median(r[1].get(c, 0.0) for r in rows) for c in cols}
        total = statistics.median(sum(r[1].values()) for r in rows)
        lines.append(
            f"| {streams} | {name} | {statistics.median(r[0] for r in rows):.0f} | {med['main']:.3f} | "
            f"{med['ember-mlx']:.3f} | {med['other']:.3f} | {total:.3f} | {statistics.median(r[2] for r in rows):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.cpu_per_token", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--servers", default="ember,bare", help="comma-separated: ember, bare, mlx-lm")
    ap.add_argument("--streams", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request with several streams")
    ap.add_argument("--tokens-single", type=int, default=256, help="tokens per request with one stream")
    ap.add_argument(
        "--bare-blas-threads",
        type=int,
        default=1,
        help="OpenBLAS threads of the bare server (1: what Ember uses for a 1-row step; 0: the library default)",
    )
    args = ap.parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("bench.cpu.cpu_per_token reads /proc: Linux only")
    if "bare" in args.servers.split(",") and max(args.streams) > 1:
        print(
            "[cpu_per_token] note: the bare server runs one request at a time; its several-stream rows "
            "measure it queueing them",
            file=sys.stderr,
        )
    print(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
