"""Memory soak: mixed traffic against `ember serve` with its RSS sampled.

    python -m sims.live.soak --minutes 3 [--model tiny] [--clients 4] [--prompt-cache-gib 0.25]

Starts `ember serve` with the RAM prompt cache capped (``--prompt-cache``), the
SSD tier on (a temporary folder, ``--ssd-cache-max``) and idle demotion after
2 s, then runs ``--clients`` threads of traffic for ``--minutes``: long
prompts (1-4k tokens) and short ones, drawn from a pool of shared prefixes
with random tails (RAM hits, evictions, spills, SSD restores), streaming and
not, and a share of clients that drop their stream after the first chunk.
The server's RSS (``/proc/<pid>/status`` VmRSS; ``ps`` elsewhere) is sampled
every second.

The bound it checks (printed with its terms): RSS once the model is loaded
and warmed up + the RAM prompt-cache cap + the spill queue cap + one full
batch of the longest prompts' KV + 256 MiB of allocator slack. "Plateaus":
the mean RSS of the last third of the run is within 10% (or 64 MiB) of the
middle third's. Prints a table of the curve (``--markdown`` for docs) and
exits 1 if the bound or the plateau fails.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import httpx

from engine.units import MIB
from sims.live.server import read_url, serve_command


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) * 1024 if out else 0


def _read_url(proc: subprocess.Popen[str], timeout_s: float = 300) -> str:
    url = read_url(proc, timeout_s)
    if url is None:
        raise RuntimeError("ember serve did not start")
    return url


def _server_pid(proc: subprocess.Popen) -> int:
    """The serving process: `ember` may re-exec itself once (OpenBLAS), keeping its pid."""
    return proc.pid


class Traffic:
    def __init__(self, url: str, args: argparse.Namespace, vocab: int):
        self.url = url
        self.args = args
        self.vocab = vocab
        rng = random.Random(0)
        self.prefixes = [[rng.randrange(3, vocab) for _ in range(rng.choice((64, 512, 1024, 2048)))] for _ in range(24)]
        self.counts = {"requests": 0, "dropped": 0, "errors": 0, "long": 0}
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self.stop.is_set():
                long = rng.random() < 0.35
                prefix = rng.choice(self.prefixes)
                tail = [
                    rng.randrange(3, self.vocab)
                    for _ in range(rng.randrange(1000, 2000) if long else rng.randrange(4, 64))
                ]
                prompt = (prefix + tail)[: self.args.max_prompt]
                body = {
                    "prompt": prompt,
                    "max_tokens": rng.choice((8, 16, 48)),
                    "temperature": rng.choice((0.0, 0.8)),
                    "ignore_eos": True,
                }
                drop = rng.random() < 0.2
                try:
                    if drop or rng.random() < 0.5:
                        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            for i, _ in enumerate(r.iter_bytes()):
                                if drop and i >= 1:
                                    break  # the client goes away mid-stream
                    else:
                        r = c.post("/v1/completions", json=body)
                        if r.status_code != 200 and r.status_code != 429:
                            self._count("errors")
                    self._count("requests")
                    if drop:
                        self._count("dropped")
                    if long:
                        self._count("long")
                except httpx.HTTPError:
                    self._count("errors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-cache-gib", type=float, default=0.25)
    ap.add_argument("--ssd-cache-max-gib", type=float, default=1.0)
    ap.add_argument("--spill-queue-gib", type=float, default=0.25)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ember-soak-") as d:
        cmd = serve_command(
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--prompt-cache",
            str(args.prompt_cache_gib),
            "--ssd-cache",
            d,
            "--ssd-cache-max",
            str(args.ssd_cache_max_gib),
            "--ssd-demote-idle",
            "2",
            "--spill-queue",
            str(args.spill_queue_gib),
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            url = _read_url(proc)
            pid = _server_pid(proc)
            with httpx.Client(base_url=url, timeout=300) as c:
                # warm-up: one long request, so the ready RSS includes compiled kernels and buffers
                c.post("/v1/completions", json={"prompt": list(range(3, 2003)), "max_tokens": 8})
            kv_per_token = _kv_bytes_per_token(url, d)
            ready = rss_bytes(pid)
            vocab = 2000
            traffic = Traffic(url, args, vocab)
            threads = [threading.Thread(target=traffic.client, args=(i,), daemon=True) for i in range(args.clients)]
            for t in threads:
                t.start()
            samples: list[tuple[float, int]] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.minutes * 60:
                samples.append((time.monotonic() - t0, rss_bytes(pid)))
                time.sleep(1.0)
            traffic.stop.set()
            for t in threads:
                t.join(timeout=300)
            with httpx.Client(base_url=url, timeout=60) as c:
                final_stats = c.get("/stats").json()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()

    batch_kv = args.batch * args.max_prompt * kv_per_token
    terms = {
        "ready RSS": ready,
        "RAM prompt-cache cap": int(args.prompt_cache_gib * (1 << 30)),
        "spill queue cap": int(args.spill_queue_gib * (1 << 30)),
        f"batch KV ({args.batch} x {args.max_prompt} tokens x {kv_per_token} B)": batch_kv,
        "allocator slack": 256 * MIB,
    }
    bound = sum(terms.values())
    rss = [r for _, r in samples]
    n = len(rss)
    mid, last = rss[n // 3 : 2 * n // 3], rss[2 * n // 3 :]
    peak = max(rss)
    growth = statistics.mean(last) - statistics.mean(mid)
    plateau = growth <= max(0.10 * statistics.mean(mid), 64 * MIB)

    cmdline = (
        f"python -m sims.live.soak --minutes {args.minutes:g} --model {args.model} --clients {args.clients} "
        f"--prompt-cache-gib {args.prompt_cache_gib:g} --spill-queue-gib {args.spill_queue_gib:g}"
    )
    print(f"# {cmdline}")
    print(f"traffic: {traffic.counts}; server exit code {rc}")
    ps, ss = final_stats.get("prompt_cache", {}), final_stats.get("ssd_cache", {})
    print(
        f"prompt cache: entries {ps.get('entries')}, bytes {ps.get('bytes')}, evictions {ps.get('evictions')}; "
        f"ssd: entries {ss.get('entries')}, spills {ss.get('spills')}, restores {ss.get('restores')}, evictions {ss.get('evictions')}"
    )
    print("bound terms: " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in terms.items()) + f" = {bound / MIB:.0f} MiB")
    step = max(1, n // 12)
    rows = [(samples[i][0], samples[i][1]) for i in range(0, n, step)] + [samples[-1]]
    if args.markdown:
        print("\n| t (s) | RSS (MiB) |\n|---|---|")
        for at, r in rows:
            print(f"| {at:.0f} | {r / MIB:.0f} |")
    else:
        for at, r in rows:
            print(f"  t={at:6.0f} s  RSS {r / MIB:7.0f} MiB")
    print(
        f"peak {peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB; mean middle third {statistics.mean(mid) / MIB:.0f} MiB, "
        f"last third {statistics.mean(last) / MIB:.0f} MiB (growth {growth / MIB:+.0f} MiB): "
        f"{'PLATEAU' if plateau else 'STILL GROWING'}, {'within' if peak <= bound else 'OVER'} the bound"
    )
    return 0 if peak <= bound and plateau and rc == 0 else 1


def _kv_bytes_per_token(url: str, ssd_dir: str) -> int:
    """KV bytes per token of the served model, from an entry the warm-up wrote
    (flushed first); 0 if none can be read."""
    from engine.kv import kvfile
    from engine.kv.disk import RealDisk

    req = urllib.request.Request(
        url + "/admin/cache/flush", data=b"{}", headers={"content-type": "application/json"}, method="POST"
    )
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except Exception:  # noqa: BLE001 - a failed flush leaves no entry: the term is then 0
        pass
    best = 0
    for p, _, fs in os.walk(ssd_dir):
        for f in fs:
            if f.endswith(".kv"):
                h, _ = kvfile.read_header(RealDisk(), os.path.join(p, f))
                total = sum(s.bytes for layer in h.layers for s in getattr(layer, "tensors", []))
                if h.tokens:
                    best = max(best, total // len(h.tokens))
    return best


if __name__ == "__main__":
    sys.exit(main())
