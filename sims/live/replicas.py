"""N Ember replicas behind the SGLang Model Gateway, on one machine.

    python -m sims.live.replicas --n 2 --router cache_aware                # fake GPU replicas, gateway on :30000
    python -m sims.live.replicas --n 2 --router round_robin --port 8000 -- --model tiny --batch 4

Starts ``ember serve --port P [replica args]`` N times on free
ports (``--fake-gpu`` unless replica args are given), waits for each
``/health``, then ``python -m sglang_router.launch_router --worker-urls …
--policy POLICY`` and waits until it has registered every replica; prints the
gateway's URL and serves until SIGINT/SIGTERM, then stops the gateway and
drains the replicas (SIGTERM). ``--router none`` starts the replicas only.
The same ``Cluster`` runs the gateway tests and ``bench.serve.affinity``.
Needs the ``cluster`` extra (``pip install -e ".[cluster]"``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from sims.live.replay import free_port
from sims.live.server import serve_command

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class Cluster:
    """Replicas (and the gateway) as child processes; a context manager.

    ``url`` is the gateway (or the only replica with ``policy=None`` and
    ``n=1``); ``replica_urls`` are the replicas themselves."""

    def __init__(
        self,
        n: int = 2,
        policy: str | None = "cache_aware",
        replica_args: list[str] | None = None,
        *,
        port: int | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 120.0,
        router_args: list[str] | None = None,
    ):
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} ({', '.join(POLICIES)})")
        self.n = n
        self.policy = policy
        self.replica_args = ["--fake-gpu"] if replica_args is None else list(replica_args)
        self.port = port
        self.router_args = list(router_args or [])
        self.start_timeout_s = start_timeout_s
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="ember-cluster-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.replica_urls: list[str] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.url = ""

    def _metrics_args(self) -> list[str]:
        """The gateway's Prometheus port, free, unless the caller chose one: its
        default (29000) is one per machine, so a second cluster's gateway (a
        second pytest-xdist worker, two benchmarks) exited 1 at start."""
        if "--prometheus-port" in self.router_args:
            return []
        return ["--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> Cluster:
        try:
            for i in range(self.n):
                port = free_port()
                argv = serve_command(*self.replica_args, port=port, log_level=None)
                self.replicas.append(self._spawn(argv, f"replica-{i}.log"))
                self.replica_urls.append(f"http://127.0.0.1:{port}")
            for proc, url in zip(self.replicas, self.replica_urls):
                self._wait(proc, url + "/health", lambda r: r.status_code == 200, "replica")
            if self.policy is None:
                self.url = self.replica_urls[0]
                return self
            if not router_available():
                raise RuntimeError('the gateway needs sglang-router: pip install -e ".[cluster]"')
            port = self.port or free_port()
            argv = [
                sys.executable, "-m", "sglang_router.launch_router",
                "--worker-urls", *self.replica_urls,
                "--policy", self.policy,
                "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warn",
                *self._metrics_args(),
                *self.router_args,
            ]  # fmt: skip
            self.router = self._spawn(argv, "gateway.log")
            self.url = f"http://127.0.0.1:{port}"
            self._wait(self.router, self.url + "/workers", self._all_registered, "gateway")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_registered(self, r: httpx.Response) -> bool:
        if r.status_code != 200:
            return False
        workers = r.json().get("workers", [])
        healthy = [w for w in workers if w.get("is_healthy") and w.get("model_id") not in (None, "unknown")]
        return len(healthy) == self.n

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / log_name, "ab") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def _wait(self, proc: subprocess.Popen[bytes], url: str, ok: object, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the {what} exited with status {proc.returncode} while starting (logs: {self.log_dir})"
                    )
                try:
                    if ok(client.get(url)):  # type: ignore[operator]
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {what} at {url} was not ready within {self.start_timeout_s} s (logs: {self.log_dir})"
                    )
                time.sleep(0.1)

    def stop(self, grace_s: float = 30.0) -> None:
        """The gateway first (no new requests), then each replica drains (SIGTERM)."""
        procs = ([self.router] if self.router is not None else []) + self.replicas
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.router, self.replicas = None, []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sims.live.replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2, help="replicas")
    ap.add_argument("--router", default="cache_aware", choices=[*POLICIES, "none"], help="the gateway's policy")
    ap.add_argument("--port", type=int, default=30000, help="the gateway's port")
    ap.add_argument("--log-dir", default="cluster-logs")
    ap.add_argument("replica_args", nargs="*", help="after --: flags for every `ember serve` (default --fake-gpu)")
    args = ap.parse_args(argv)
    cluster = Cluster(
        args.n,
        None if args.router == "none" else args.router,
        args.replica_args or None,
        port=args.port,
        log_dir=args.log_dir,
    )
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with cluster:
        for url in cluster.replica_urls:
            print(f"replica {url}", flush=True)
        print(
            f"ember cluster: {args.n} replicas, policy {args.router}, OpenAI API at {cluster.url}/v1 (logs: {args.log_dir})",
            flush=True,
        )
        while not stop:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
