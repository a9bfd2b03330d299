"""Count exit codes of graceful shutdowns: start `ember serve` on the bundled
model, serve a request or two, SIGTERM, wait; N times, P at a time.

    python -m sims.live.shutdowns --runs 25 --parallel 2 [--ssd]

Prints one line per run and a summary; exits 1 if any run did not exit 0
(the stderr tail of each such run is printed). Issue #23 item 6: 4 of 71
graceful shutdowns ended in SIGABRT ("terminate called without an active
exception").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from sims.live.server import read_url, serve_command


def _tail(path: str, n: int) -> str:
    with open(path) as f:
        return f.read()[-n:]


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def one(i: int, args: argparse.Namespace) -> tuple[int, int | None, str]:
    with tempfile.TemporaryDirectory(prefix="ember-shutdown-") as d:
        cmd = serve_command("--model", args.model, log_level="info")
        if args.ssd:
            cmd += ["--ssd-cache", d]
        if args.gdb:  # a backtrace of every thread if the process aborts
            cmd = [
                "gdb",
                "-q",
                "-batch",
                "-ex",
                "set pagination off",
                "-ex",
                "handle SIGTERM nostop noprint pass",
                "-ex",
                "handle SIGPIPE nostop noprint pass",
                "-ex",
                "run",
                "-ex",
                "thread apply all bt 30",
                "--args",
                *cmd,
            ]
            env_extra = {"EMBER_NO_OPENBLAS": "1"}  # no re-exec: gdb must hold the serving process itself
        else:
            env_extra = {}
        err_path = os.path.join(d, "stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env_extra},
            )
            try:
                url = read_url(proc, args.start_timeout)
                if url is None:
                    proc.kill()
                    proc.wait()
                    return i, None, _tail(err_path, 2000)
                for k in range(args.requests):
                    _post(url + "/v1/completions", {"prompt": f"shutdown run {i} request {k}: " * 4, "max_tokens": 4})
                pid = proc.pid
                if args.gdb:
                    text = _tail(err_path, 1 << 30)
                    pid = int(text.split("Started server process [", 1)[1].split("]", 1)[0])
                os.kill(pid, signal.SIGTERM)
                rc = proc.wait(timeout=120)
                if args.gdb:  # gdb reports the inferior's end on its stdout
                    out = proc.stdout.read() if proc.stdout is not None else ""
                    with open(err_path, "a") as f:
                        f.write(out)
                    rc = 0 if "exited normally" in out else (-6 if "SIGABRT" in out else 1)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
        return i, rc, _tail(err_path, 12000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=25)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--ssd", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--gdb", action="store_true", help="run each server under gdb (backtraces on abort)")
    args = ap.parse_args()
    bad = []
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for i, rc, tail in pool.map(lambda i: one(i, args), range(args.runs)):
            print(f"run {i}: rc={rc}", flush=True)
            if rc != 0:
                bad.append((i, rc, tail))
    print(f"{args.runs - len(bad)} of {args.runs} exited 0 in {time.monotonic() - t0:.0f} s")
    for i, rc, tail in bad:
        print(f"--- run {i} rc={rc} stderr tail:\n{tail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
