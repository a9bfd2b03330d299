"""The SPMD engine over mx.distributed: two ranks on the ring backend on
localhost (``ember serve --distributed tensor|pipeline``), started as
``mlx.launch -n 2 --backend ring`` starts them (MLX_RANK + a JSON hostfile),
but by the test, so that killing one rank does not take the other down with it
(mlx.launch stops every rank when one exits).

Oracles: mlx-lm's own ``stream_generate`` on a single process (greedy),
never-cached, also for a second turn the ranks serve from their RAM tiers. The
tensor-parallel engine runs the bundled llama (``model.shard``); the pipeline
engine a tiny random-weight qwen2, whose mlx-lm model mixes in PipelineMixin.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate  # noqa: E402

from engine.models import resolve_model  # noqa: E402
from sims.live.replay import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # two mx.distributed ranks per test, launched and torn down

N = 24
PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "# Utilities for parsing\n",
]
DEATH_BOUND_S = 5.0  # a lost rank: the ring's error (~1 s) or the next heartbeat (1 s) plus slack on a shared machine


def _ring_works() -> bool:
    return hasattr(mx, "distributed") and mx.distributed.is_available()


if not _ring_works():
    pytest.skip("this MLX build has no distributed backend", allow_module_level=True)


class Ranks:
    """``ember serve --distributed MODE`` on ``n`` local ranks of the ring backend."""

    def __init__(self, tmp: Path, model: str, mode: str, n: int = 2, extra: list[str] | None = None):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
        argv = [
            sys.executable,
            "-m",
            "transport.cli",
            "serve",
            "--model",
            model,
            "--distributed",
            mode,
            "--port",
            str(self.port),
            *(extra or []),
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(n):
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "PYTHONUNBUFFERED": "1"}
            with open(tmp / f"rank{r}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                )

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r}\n" + (self.tmp / f"rank{r}.log").read_text(errors="replace")[-3000:]
            for r in range(len(self.procs))
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError("a rank exited while starting:\n" + self.logs())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("not ready in time:\n" + self.logs())

    def stop(self) -> list[int | None]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        out = []
        for p in self.procs:
            try:
                out.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
                out.append(p.wait())
        return out

    def __enter__(self) -> Ranks:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def complete(url: str, prompt: str, n: int = N) -> str:
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def reference(path: str, prompts: list[str], n: int = N) -> list[str]:
    """mlx-lm alone on one process, greedy, EOS off."""
    model, tok = load(path)
    tok.eos_token_ids = set()
    return ["".join(r.text for r in stream_generate(model, tok, p, max_tokens=n)) for p in prompts]


# a session's first turn, long enough (37 tokens) for the RAM tier to reuse (min_cached_prefix 16)
SESSION = 'class Point:\n    """A point in the plane, with its two coordinates."""\n\n    def __init__(self, x, y):\n'


def check_both(ranks: Ranks, path: str) -> None:
    want = reference(path, PROMPTS)
    [first] = reference(path, [SESSION])
    turn2 = SESSION + first + "\n    def norm(self):\n        return"
    [want2] = reference(path, [turn2])
    assert complete(ranks.url, SESSION) == first  # alone
    with ThreadPoolExecutor(4) as pool:  # four at once: one batch on every rank
        got = list(pool.map(lambda p: complete(ranks.url, p), PROMPTS))
    assert got == want
    # a second turn starts from the RAM tier's cache on every rank (in lock-step)
    r = httpx.post(
        ranks.url + "/v1/completions", json={"prompt": turn2, "max_tokens": N, "ignore_eos": True}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r.json()["usage"]
    assert r.json()["choices"][0]["text"] == want2
    stats = httpx.get(ranks.url + "/stats", timeout=5).json()
    assert stats["scheduler"]["finished"] == 2 + len(PROMPTS)
    dist = stats["distributed"]
    assert (dist["rank"], dist["ranks"]) == (0, 2)
    assert dist["plans_sent"] == stats["scheduler"]["steps"]  # every step went to the followers first
    assert dist["caches_shared"] >= 1 + len(PROMPTS)


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(resolve_model("tiny"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny) -> str:
    """A tiny random-weight qwen2 (4 layers) with the bundled tokenizer."""
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_config, save_model

    out = tmp_path_factory.mktemp("qwen2-tiny")
    config = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    mx.random.seed(7)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny) / name, out / name)
    assert (out / "model.safetensors.index.json").is_file()  # sharded_load's pipeline path reads it
    return str(out)


CONSTRAINED = {
    "messages": [{"role": "user", "content": "Give a point."}],
    "max_tokens": 40,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "p",
            "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
}


def one_process_chat(tmp: Path, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request to a plain single-process ``ember serve``."""
    port = free_port()
    with open(tmp / "single.log", "wb") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "transport.cli", "serve", "--model", model, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and p.poll() is None, (tmp / "single.log").read_text()
            time.sleep(0.2)
        return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        p.terminate()
        p.wait(timeout=60)


def test_tensor_parallel_equals_one_process(tmp_path, tiny):
    # a grammar-constrained request: the constraint rides in the plan's
    # SamplingParams and every rank builds its own matcher
    want_constrained = one_process_chat(tmp_path, tiny, CONSTRAINED)["choices"][0]["message"]["content"]
    with Ranks(tmp_path, tiny, "tensor") as ranks:
        check_both(ranks, tiny)
        r = httpx.post(ranks.url + "/v1/chat/completions", json=CONSTRAINED, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want_constrained
        # a graceful stop of rank 0 stops the followers (told, not lost)
        ranks.procs[0].send_signal(signal.SIGTERM)
        assert ranks.procs[0].wait(timeout=60) == 0
        assert ranks.procs[1].wait(timeout=30) == 0, ranks.logs()
    assert "rank 1/2 following (tensor)" in ranks.logs()


def test_pipeline_equals_one_process(tmp_path, qwen2_dir):
    want = reference(qwen2_dir, PROMPTS)
    assert len(set(want)) == len(want)  # the random model does not say the same thing to every prompt
    with Ranks(tmp_path, qwen2_dir, "pipeline") as ranks:
        check_both(ranks, qwen2_dir)
        # then, idle, rank 1 dies: no request runs, rank 0's heartbeat notices (one launch fewer)
        ranks.procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while (h := httpx.get(ranks.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() - killed < DEATH_BOUND_S, "no request ran: the heartbeat must notice"
            time.sleep(0.05)
        print(f"idle loss noticed after {time.monotonic() - killed:.2f} s")
        assert h.json()["status"] == "dead"


def test_speculation_over_tensor_ranks(tmp_path, tiny):
    """The draft model runs on rank 0 alone (whole, unsharded); its windows are
    verified by the sharded target inside the broadcast plans."""
    want = reference(tiny, PROMPTS)
    with Ranks(tmp_path, tiny, "tensor", extra=["--draft-model", "tiny-draft"]) as ranks:
        body = {"prompt": PROMPTS[0], "max_tokens": N, "ignore_eos": True}
        r = httpx.post(ranks.url + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == want[0]
        assert r["usage"]["speculation"]["drafted"] > 0, r["usage"]  # it did speculate
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(ranks.url, p), PROMPTS))
        assert got == want


def test_a_rank_that_dies_ends_open_requests_and_health(tmp_path, tiny):
    with Ranks(tmp_path, tiny, "tensor") as ranks:
        body = {"prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", ranks.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:  # the stream is running
                if line.startswith("data: ") and '"text"' in line:
                    break
            ranks.procs[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
            ended = time.monotonic() - killed
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead", err
        assert "rank was lost" in err["message"] or "[ring]" in err["message"], err  # the cause, not a cancellation
        assert ended < DEATH_BOUND_S, ended
        print(f"stream ended {ended:.2f} s after the kill")
        while (h := httpx.get(ranks.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() - killed < DEATH_BOUND_S
            time.sleep(0.05)
        assert h.status_code == 503 and h.json()["status"] == "dead"
        r = httpx.post(ranks.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    st = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return st == "" or st.startswith("Z")


def test_sigterm_to_mlx_launch_stops_every_rank(tmp_path, tiny):
    """``mlx.launch`` forwards no SIGTERM: it dies and its ranks are adopted.
    Rank 0 notices its parent is gone and stops gracefully, telling rank 1."""
    launcher = shutil.which("mlx.launch", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("no mlx.launch next to this Python")
    port = free_port()
    argv = [launcher, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "transport.cli", "serve"]
    argv += ["--model", tiny, "--distributed", "tensor", "--port", str(port)]
    with open(tmp_path / "launch.log", "wb") as log:
        launch = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and launch.poll() is None, (tmp_path / "launch.log").read_text()
            time.sleep(0.2)
        children = subprocess.run(["pgrep", "-P", str(launch.pid)], capture_output=True, text=True).stdout
        ranks = [int(p) for p in children.split()]
        assert len(ranks) == 2, ranks
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=30)
        stopped = time.monotonic()
        while not all(_gone(p) for p in ranks):
            assert time.monotonic() - stopped < 30, "ranks still running after the launcher's SIGTERM"
            time.sleep(0.2)
        print(f"both ranks gone {time.monotonic() - stopped:.1f} s after SIGTERM to mlx.launch")
    finally:
        try:
            os.killpg(launch.pid, signal.SIGKILL)  # the ranks share the launcher's process group
        except ProcessLookupError:
            pass
