"""Crash test with real processes: SIGKILL ``ember serve --ssd-cache DIR`` at
random moments around write-behind, restart it, and check the durability
contract each time.

    python -m sims.live.crashtest                    # 50 kills on the fake GPU
    python -m sims.live.crashtest --kills 10 --model tiny --seed 3

Each life: start the server on the same SSD folder; check that it came back,
that no ``*.tmp`` survived its startup scan, and that prompts a flush had
answered 200 for (in an earlier life) restore at least ``len - 1`` tokens;
then run a few multi-turn conversations, sometimes POST a flush, and SIGKILL
the server somewhere in the write-behind window (debounce, snapshot, tensor
writes, rename) or in the middle of a flush. Every answer, restored or not,
must equal the cold-prefill answer: the fake GPU's cache-free oracle, or for
a real model the answer a server without any cache gave for the same prompt.

All traffic goes to 127.0.0.1. Exit status 0 when every check held; the
summary line prints the command that reproduces the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sims.live.server import serve_command, serving_url

# ---------------------------------------------------------------------------
# A server process.


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        status, body = self.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        if status != 200:
            raise RuntimeError(f"completion answered {status}: {body}")
        return body

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_server(
    ssd_dir: str | Path | None,
    log: Path,
    *,
    model: str = "fake",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Server:
    """Start ``ember serve`` on a free port and wait until it says it serves."""
    args = serve_command(log_level="info")
    args += ["--ssd-cache", str(ssd_dir)] if ssd_dir is not None else []
    args += ["--fake-gpu"] if model == "fake" else ["--model", model]
    args += extra or []
    full_env = {**os.environ, **(env or {})}
    if model == "fake":
        full_env.setdefault("EMBER_NO_OPENBLAS", "1")  # no MLX in play: skip the BLAS re-exec
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            url = serving_url(line)
            if url is not None:
                return Server(proc, url, log)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving:\n{text[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not come back within {timeout_s}s:\n{log.read_text(errors='replace')[-3000:]}")


def tmp_files(root: str | Path) -> list[Path]:
    return sorted(Path(root).rglob("*.tmp"))


# ---------------------------------------------------------------------------
# What a cold prefill answers.


class FakeOracle:
    """The fake GPU's cache-free continuation (``engine.fake.gpu.expected_tokens``)."""

    def __init__(self) -> None:
        from engine.fake.tokenizer import ByteTokenizer

        self.tok = ByteTokenizer()

    def answer(self, prompt: list[int], max_tokens: int) -> str:
        from engine.fake.gpu import expected_tokens

        return self.tok.decode(expected_tokens(prompt, max_tokens))

    def close(self) -> None:
        pass


class ColdServerOracle:
    """A second server with no prompt cache at all: every answer is a cold prefill."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.server = start_server(None, workdir / "cold.log", model=model, extra=["--prompt-cache", "0"])
        self.memo: dict[tuple[tuple[int, ...], int], str] = {}

    def answer(self, prompt: list[int], max_tokens: int) -> str:
        key = (tuple(prompt), max_tokens)
        if key not in self.memo:
            self.memo[key] = self.server.complete(prompt, max_tokens)["choices"][0]["text"]
        return self.memo[key]

    def close(self) -> None:
        self.server.terminate()


# ---------------------------------------------------------------------------
# The run.


@dataclass
class Result:
    kills: int = 0
    kills_in_flush: int = 0
    restarts: int = 0
    requests: int = 0
    restores_checked: int = 0
    restored_tokens: int = 0
    tmp_seen_after_kill: int = 0
    flushes_200: int = 0
    flushes_503: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def run(kills: int, seed: int, *, model: str = "fake", workdir: Path | None = None, verbose: bool = True) -> Result:
    rng = random.Random(seed)
    work = Path(workdir or tempfile.mkdtemp(prefix="ember-crashtest-"))
    ssd = work / "ssd"
    ssd.mkdir(parents=True, exist_ok=True)
    vocab = 256 if model == "fake" else None
    oracle: Any = FakeOracle() if model == "fake" else ColdServerOracle(model, work)
    res = Result()
    durable: list[tuple[list[int], int]] = []  # (prompt, max_tokens) a 200 flush covered
    max_prompt = 3000 if model == "fake" else 200

    def say(msg: str) -> None:
        if verbose:
            print(msg, flush=True)

    def check(server: Server, prompt: list[int], max_tokens: int, *, restorable: bool) -> None:
        body = server.complete(prompt, max_tokens)
        res.requests += 1
        text = body["choices"][0]["text"]
        cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        want = oracle.answer(prompt, max_tokens)
        if text != want:
            res.failures.append(
                f"life {res.restarts}: {len(prompt)}-token prompt (cached {cached}) answered {text!r}, cold prefill {want!r}"
            )
        if restorable:
            res.restores_checked += 1
            res.restored_tokens += cached
            if cached < len(prompt) - 1:
                res.failures.append(
                    f"life {res.restarts}: a flushed {len(prompt)}-token prompt restored only {cached} tokens"
                )

    try:
        life = 0
        while res.kills < kills:
            leftovers = tmp_files(ssd)
            res.tmp_seen_after_kill += len(leftovers)
            try:
                server = start_server(ssd, work / f"life-{life}.log", model=model)
            except RuntimeError as exc:
                res.failures.append(f"life {life}: the server did not come back: {exc}")
                break
            res.restarts += life > 0
            if tmp_files(ssd):
                res.failures.append(f"life {life}: *.tmp files survived the startup scan: {tmp_files(ssd)}")
            # What a 200 flush covered in an earlier life must restore now (the latest always, a sample of the rest).
            if durable:
                sample = [durable[-1]] + rng.sample(durable[:-1], min(2, len(durable) - 1))
                for prompt, n in sample:
                    check(server, prompt, n, restorable=True)

            # A few conversations, some turns extending earlier ones.
            convs: list[list[int]] = []
            completed: list[tuple[list[int], int]] = []
            for _ in range(rng.randint(2, 5)):
                if convs and rng.random() < 0.5:  # the next turn: its KV prefix diverges after the old prompt
                    prompt = rng.choice(convs) + _words(rng, vocab, rng.randint(5, 60))
                else:
                    prompt = _words(rng, vocab, rng.randint(50, max_prompt))
                prompt = prompt[-max_prompt:]
                n = rng.randint(1, 12)
                check(server, prompt, n, restorable=False)
                convs.append(prompt)
                completed.append((prompt, n))
                if rng.random() < 0.3:
                    status, report = server.post("/admin/cache/flush")
                    if status == 200 and report.get("durable"):
                        res.flushes_200 += 1
                        durable.extend(completed)
                        completed = []
                    else:
                        res.flushes_503 += 1

            # Kill: in the middle of a flush, or somewhere in the write-behind window.
            if rng.random() < 0.3:
                t = threading.Thread(target=_quiet_flush, args=(server,), daemon=True)
                t.start()
                time.sleep(rng.uniform(0.0, 0.05))
                server.kill()
                t.join()
                res.kills_in_flush += 1
            else:
                time.sleep(rng.uniform(0.0, 1.6))  # the debounce is 1 s: before, during and after the writes
                server.kill()
            res.kills += 1
            life += 1
            say(
                f"[crashtest] kill {res.kills}/{kills} durable={len(durable)} requests={res.requests} tmp_left={len(tmp_files(ssd))} failures={len(res.failures)}"
            )

        # One last life: it must come back and restore the latest durable prompt.
        server = start_server(ssd, work / "final.log", model=model)
        res.restarts += 1
        if tmp_files(ssd):
            res.failures.append(f"final life: *.tmp files survived the startup scan: {tmp_files(ssd)}")
        for prompt, n in durable[-3:]:
            check(server, prompt, n, restorable=True)
        rc = server.terminate()
        if rc != 0:
            res.failures.append(f"final SIGTERM exited {rc}")
    finally:
        oracle.close()
    return res


def _words(rng: random.Random, vocab: int | None, n: int) -> list[int]:
    if vocab is None:  # a real tokenizer: ids inside any vocabulary of 256 or more
        return [rng.randrange(3, 256) for _ in range(n)]
    return [rng.randrange(32, 127) for _ in range(n)]  # printable: the text compares cleanly


def _quiet_flush(server: Server) -> None:
    try:
        server.post("/admin/cache/flush", timeout=30)
    except Exception:  # noqa: BLE001 - the server is killed under it on purpose
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sims.live.crashtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="fake", help="fake (the fake GPU) or a model for ember serve --model (e.g. tiny)")
    p.add_argument("--workdir", type=Path, help="keep the SSD folder and server logs here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    res = run(args.kills, args.seed, model=args.model, workdir=args.workdir)
    summary = {
        k: getattr(res, k)
        for k in (
            "kills",
            "kills_in_flush",
            "restarts",
            "requests",
            "restores_checked",
            "restored_tokens",
            "tmp_seen_after_kill",
            "flushes_200",
            "flushes_503",
        )
    }
    print(f"[crashtest] {json.dumps(summary)} failures={len(res.failures)} wall_s={time.monotonic() - t0:.1f}")
    for f in res.failures[:20]:
        print(f"[crashtest] FAIL {f}")
    print(
        f"[crashtest] {'OK' if res.ok else 'FAILED'}: reproduce with python -m sims.live.crashtest --kills {args.kills} --seed {args.seed} --model {args.model}"
    )
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
