"""An agent session, end to end, against Ember and its peers side by side (issue #32).

    python -m bench.agent_session [--model smollm2-135m] [--turns 15] [--restart-at N]
        [--max-tokens 64] [--peers vllm-mlx,rapid-mlx] [--out docs/bench/agent-session.md]
    python -m bench.agent_session --model gemma3-270m --turns 12      # a completion session
    python -m bench.agent_session --setup-peers                       # make the peers' venvs, then exit

One session: a system prompt listing tools, then turns of tool results — real
excerpts of this repository's source files and real test names as test output —
each followed by a short greedy answer that quotes them, growing to thousands
of tokens. Every server gets the same turns in the same order; each reply is
appended to its own history (so a server whose reply differs sees a different
next prompt, and says so in the "same" column). Before turn ``--restart-at``
(default: the middle) every server is stopped (SIGTERM, graceful) and started
again: Ember with its defaults (the SSD tier on, in a fresh folder through
``EMBER_KV_CACHE_DIR``; speculation as its default), mlx_lm.server with its own
prompt cache, the peers as /work/shared/ANCHORS.md says (temperature and
max_tokens always sent: both default to 0.7 and 32k).

Per turn: prompt tokens, cached tokens, TTFT, decode tok/s, reply identical to
mlx_lm.server's. Then the session totals and the targets' verdicts
(``bench.agent_session_report``). Where a target misses, the time of each of
Ember's turns is split: prefill of its new tokens into weights and attention by
an in-process probe of one layer at the turn's context (``attention_share``:
the fused attention of ``new`` queries over ``context`` keys against the
layer's projections and MLP over ``new`` tokens), decode, and restore.

The servers run one after another per turn (never at once), so the load they
see is alike; the load average is printed at each turn. ``--setup-peers``
creates ``VENVS/vllm-mlx`` and ``VENVS/rapid-mlx`` (pip installs torch 2.13.0,
mlx[cpu] and the peer, then removes torchvision, whose only build here is
CUDA-linked); it downloads a lot and was not run when this was written.
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
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agent_session_report import (
    REFERENCE,
    SUBJECT,
    Turn,
    split_table,
    split_turn,
    totals_table,
    turn_table,
    verdict_table,
    verdicts,
)
from bench.serve.vs_mlx_lm import Server, free_port, model_dir_in

ROOT = Path(__file__).resolve().parent.parent
PEER_VENVS = Path(os.environ.get("EMBER_PEER_VENVS", "/work/venvs/peers"))
PEER_PINS = {"vllm-mlx": "vllm-mlx==0.6.0", "rapid-mlx": "rapid-mlx==0.16.10"}

SYSTEM = """You are a coding agent working in the Ember repository (an LLM inference engine on MLX).
Tools you may call, one per turn, as JSON {"tool": NAME, "args": {...}}:
- read_file(path: str, start: int, lines: int): a file's lines.
- run_tests(target: str): pytest's output for a test file or node id.
- grep(pattern: str, path: str): matching lines with their line numbers.
After each tool result, answer in one or two sentences and quote the exact line the question asks about."""

FILES = [
    "engine/speculation/costs.py",
    "engine/kv/cold_store.py",
    "transport/cli.py",
    "actors/verifier.py",
    "engine/kv/prompt_cache.py",
    "bench/serve/vs_mlx_lm.py",
    "ember/assemble.py",
    "engine/config.py",
    "actors/scheduler.py",
    "engine/speculation/policy.py",
]
EXCERPT_CHARS = 1100  # ~300 tokens of source per tool result, as the session


def excerpt(path: str, k: int) -> tuple[str, int]:
    lines = (ROOT / path).read_text().splitlines()
    start = (k * 37) % max(1, len(lines) - 40)
    out, n = [], 0
    for i in range(start, len(lines)):
        out.append(f"{i + 1:5d}  {lines[i]}")
        n += len(out[-1]) + 1
        if n >= EXCERPT_CHARS:
            break
    return "\n".join(out), start + 1


def test_output(k: int) -> str:
    """Real test names of this repository in pytest's -v format."""
    rng = random.Random(k)
    names = []
    for f in sorted((ROOT / "tests").rglob("test_*.py")):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("def test_"):
                names.append(f"{f.relative_to(ROOT)}::{line[4:].split('(')[0]}")
    pick = rng.sample(names, min(14, len(names)))
    out = [f"{n} PASSED" if i != 5 else f"{n} FAILED" for i, n in enumerate(pick)]
    return "\n".join(out) + f"\n==== 1 failed, {len(pick) - 1} passed in {rng.uniform(3, 40):.2f}s ===="


def user_turns(n: int) -> list[str]:
    """The client's side of the session: tool results and the question about each."""
    out = []
    for k in range(n):
        if k % 4 == 3:
            out.append(
                f'Tool result (run_tests "tests/"):\n```\n{test_output(k)}\n```\n'
                "Which test failed? Quote its line exactly."
            )
            continue
        path = FILES[k % len(FILES)]
        text, start = excerpt(path, k)
        out.append(
            f'Tool result (read_file "{path}", start={start}):\n```\n{text}\n```\n'
            "What does the first definition in this excerpt do? Quote its line."
        )
    return out


# ---------------------------------------------------------------------------
# servers


def ember_server(model_dir: Path, work: Path, extra: list[str]) -> Server:
    port = free_port()
    srv = Server(
        SUBJECT,
        [sys.executable, "-m", "transport.cli", "serve", "--model", str(model_dir), "--port", str(port), *extra],
        port,
        work / "ember.log",
    )
    srv.env = {"EMBER_KV_CACHE_DIR": str(work / "ember-kv")}  # the default tier, in a fresh folder
    return srv


def mlx_server(model_dir: Path, work: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    return Server(REFERENCE, argv, port, work / "mlx-lm.log")


def peer_server(name: str, model_dir: Path, work: Path) -> Server:
    port = free_port()
    bin_dir = PEER_VENVS / name / "bin"
    if name == "vllm-mlx":
        argv = [str(bin_dir / "vllm-mlx"), "serve", str(model_dir), "--continuous-batching"]
        argv += ["--ssd-cache-dir", str(work / "vllm-mlx-ssd"), "--port", str(port)]
    elif name == "rapid-mlx":
        argv = [str(bin_dir / "rapid-mlx"), "--no-telemetry", "--disable-version-check", "serve", str(model_dir)]
        argv += ["--disable-model-downloads", "--port", str(port)]
    else:
        raise SystemExit(f"unknown peer {name!r}: vllm-mlx or rapid-mlx")
    if not bin_dir.exists():
        raise SystemExit(f"{name}: no venv at {bin_dir.parent}; run `python -m bench.agent_session --setup-peers`")
    # A home of its own for this run: both keep a prefix cache on disk under
    # ~/.cache/<name> across server restarts (what the restart turn measures),
    # and across runs too, so a shared home gave a peer the previous run's
    # turns as cache hits (rapid-mlx: turn 1's whole prompt cached).
    home = work / f"home-{name}"
    home.mkdir(parents=True, exist_ok=True)
    return Server(name, argv, port, work / f"{name}.log", env={"HOME": str(home)})


def setup_peers(names: list[str]) -> None:
    """The peers' venvs as /work/shared/ANCHORS.md says. Untested here (heavy download)."""
    for name in names:
        venv = PEER_VENVS / name
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "torch==2.13.0", "mlx[cpu]", PEER_PINS[name]], check=True)
        subprocess.run([*pip, "uninstall", "-y", "torchvision"], check=False)  # CUDA-linked: breaks loading
        print(f"{name}: {venv}", flush=True)


def wait_ready(srv: Server, timeout_s: float = 300.0) -> None:
    """``Server.start`` waits for /health; a peer without it answers /v1/models."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for route in ("/health", "/v1/models"):
            try:
                if httpx.get(srv.url + route, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        if srv.proc is not None and srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited; see {srv.log_path}")
        time.sleep(0.3)
    raise RuntimeError(f"{srv.name} not ready after {timeout_s}s; see {srv.log_path}")


def start(srv: Server) -> None:
    if srv.name in (SUBJECT, REFERENCE):
        srv.start(timeout_s=300)
        return
    srv.log = open(srv.log_path, "ab")  # noqa: SIM115 -- closed by Server.stop
    from bench.serve.vs_mlx_lm import server_env

    srv.proc = subprocess.Popen(srv.argv, env={**server_env(), **srv.env}, stdout=srv.log, stderr=subprocess.STDOUT)
    wait_ready(srv)


# ---------------------------------------------------------------------------
# one turn


def stream(client: httpx.Client, srv: Server, model: str, body: dict[str, Any], route: str) -> dict[str, Any]:
    body = {**body, "model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    chunks = 0
    with client.stream("POST", srv.url + route, json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{srv.name}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    pieces.append(text)
    end = time.perf_counter()
    n = int(usage.get("completion_tokens", chunks))
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return {
        "reply": "".join(pieces),
        "ttft_s": (first or end) - t0,
        "decode_tps": (n - 1) / (last - first) if first and last and last > first and n > 1 else None,
        "completion_tokens": n,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": None if cached is None else int(cached),
        "wall_s": end - t0,
    }


def as_text(history: list[dict[str, str]]) -> str:
    """The completion session's prompt: the transcript as plain text (a base model has no template)."""
    out = [f"System: {history[0]['content']}\n"]
    for m in history[1:]:
        out.append(f"\n{'User' if m['role'] == 'user' else 'Agent'}: {m['content']}\n")
    return "".join(out) + "\nAgent:"


def run_session(args: argparse.Namespace) -> list[Turn]:
    model_dir = model_dir_in(args.model, None)
    # mlx_lm.server and the peers read a quantized model through MLX's one-thread
    # quantized matmul on this CPU (docs/bench/cpu-qmm.md: a 1.5B q8 step ~5 s, a
    # 500-token prefill ~20 min): --peer-weights float32 gives them MLX's fastest
    # format instead while Ember serves its default
    peer_dir = model_dir_in(args.model, args.peer_weights)
    work = Path(tempfile.mkdtemp(prefix="ember-agent-session-"))
    servers = [
        ember_server(model_dir, work, args.ember_flags.split() if args.ember_flags else []),
        mlx_server(peer_dir, work),
    ]
    servers += [peer_server(p, peer_dir, work) for p in (args.peers.split(",") if args.peers else [])]
    dirs = {s.name: model_dir if s.name == SUBJECT else peer_dir for s in servers}
    completion = args.completion or "gemma" in args.model
    turns_text = user_turns(args.turns)
    restart_at = args.restart_at or (args.turns // 2 + 1)
    histories = {s.name: [{"role": "system", "content": SYSTEM}] for s in servers}
    rows: list[Turn] = []
    client = httpx.Client()
    print(
        f"work dir {work}; model {model_dir} (peers: {peer_dir}); {'completion' if completion else 'chat'} session",
        flush=True,
    )
    for s in servers:
        start(s)
    try:
        for k, text in enumerate(turns_text, start=1):
            if k == restart_at:
                for s in servers:
                    s.stop(signal.SIGTERM)
                for s in servers:
                    start(s)
            for s in servers:
                h = histories[s.name]
                h.append({"role": "user", "content": text})
                if completion:
                    got = stream(
                        client,
                        s,
                        str(dirs[s.name]),
                        {"prompt": as_text(h), "max_tokens": args.max_tokens},
                        "/v1/completions",
                    )
                else:
                    got = stream(
                        client,
                        s,
                        str(dirs[s.name]),
                        {"messages": h, "max_tokens": args.max_tokens},
                        "/v1/chat/completions",
                    )
                h.append({"role": "assistant", "content": got["reply"]})
                rows.append(Turn(server=s.name, turn=k, after_restart=k == restart_at, **got))
                t = rows[-1]
                print(
                    f"turn {k:2d} {s.name:14s} prompt {t.prompt_tokens:5d} cached {t.cached_tokens} "
                    f"ttft {t.ttft_s:6.2f}s decode {t.decode_tps or 0:5.1f} tok/s  load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        client.close()
        for s in servers:
            s.stop(signal.SIGTERM)
    return rows


# ---------------------------------------------------------------------------
# where a turn's time goes


_PROBE_MODELS: dict[str, Any] = {}


def attention_share(model_dir: Path, new: int, context: int, reps: int = 3) -> tuple[float, float]:
    """One decoder layer's prefill of ``new`` tokens at ``context``: the
    attention (``new`` queries over ``context`` keys, causal over the new
    part) over that plus the layer's projections and MLP over the ``new``
    tokens, the attention as ``ember serve`` runs it (the softmax kernel,
    ``engine.mlx.kernel_attention``, where it builds, else split across the
    cores); and the share of that attention its two GEMMs alone take (QK^T
    and PV at the same shapes, as MLX's fallback lays them out): the part no
    exact attention skips, the rest being the softmax and the mask. Shapes
    only: the weights are the model's, the activations random."""
    import mlx.core as mx
    from mlx_lm import load

    if str(model_dir) not in _PROBE_MODELS:
        _PROBE_MODELS[str(model_dir)] = load(str(model_dir))[0]
    model = _PROBE_MODELS[str(model_dir)]
    inner = getattr(model, "model", model)
    layer = inner.layers[0]
    attn = layer.self_attn
    hidden = attn.q_proj.weight.shape[1]
    heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or inner.args.num_attention_heads
    kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) or heads
    head_dim = attn.q_proj.weight.shape[0] // heads
    x = mx.random.normal((1, new, hidden)).astype(attn.q_proj.weight.dtype)
    q = mx.random.normal((1, heads, new, head_dim)).astype(x.dtype)
    k = mx.random.normal((1, kv_heads, context, head_dim)).astype(x.dtype)
    v = mx.random.normal((1, kv_heads, context, head_dim)).astype(x.dtype)
    mx.eval(x, q, k, v)

    def weights() -> Any:
        h = attn.o_proj(attn.q_proj(x))
        return mx.concatenate([h, attn.k_proj(x), attn.v_proj(x)], axis=-1).sum() + layer.mlp(x).sum()

    from engine.mlx import kernel_attention, softmax_kernel
    from engine.mlx import split_attention as sa

    parts = sa.default_parts()
    lib = softmax_kernel.load()

    def attention() -> Any:
        out = None
        if lib is not None:
            out = kernel_attention.attention(lib, q, k, v, scale=head_dim**-0.5, mask="causal", threads=parts)
        if out is None:
            out = sa.split_attention(q, k, v, scale=head_dim**-0.5, mask="causal", sinks=None, n=parts)
        if out is None:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal")
        return out.sum()

    rep = heads // kv_heads
    qg = q.reshape(1, kv_heads, rep, new, head_dim)
    kg, vg = mx.expand_dims(k, 2), mx.expand_dims(v, 2)

    def gemms() -> Any:
        scores = qg @ mx.swapaxes(kg, -1, -2)
        mx.eval(scores)  # materialized, as the kernel's path has it
        return (scores @ vg).sum()

    def best(f) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(f())
            ts.append(time.perf_counter() - t0)
        return min(ts)

    best(weights), best(attention), best(gemms)  # warm up
    w, a, g = best(weights), best(attention), best(gemms)
    return a / (a + w), min(1.0, g / a)


def add_splits(rows: list[Turn], model_dir: Path) -> None:
    mine = [t for t in rows if t.server == SUBJECT]
    warm = [
        t.ttft_s / max(1, t.prompt_tokens - (t.cached_tokens or 0)) for t in mine if t.turn > 1 and not t.after_restart
    ]
    per_token = sorted(warm)[len(warm) // 2] if warm else None
    for t in mine:
        new = max(1, t.prompt_tokens - (t.cached_tokens or 0))
        share, gemm = attention_share(model_dir, min(new, t.prompt_tokens), max(new, t.prompt_tokens))
        t.split = split_turn(t, share, per_token, gemm)


def report(rows: list[Turn], args: argparse.Namespace) -> str:
    vs = verdicts(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    weights = os.environ.get("EMBER_WEIGHTS")
    command = " ".join(
        [*([f"EMBER_WEIGHTS={weights}"] if weights else []), "python -m bench.agent_session", *sys.argv[1:]]
    )
    parts = [
        f"Command: `{command}`, commit `{commit.strip() or 'unknown'}`, load (1/5/15 min) at the end "
        + "/".join(f"{x:.1f}" for x in os.getloadavg()),
        "## Per turn\n\n" + turn_table(rows),
        "## Session totals\n\n" + totals_table(rows),
        "## Targets\n\n" + verdict_table(vs),
    ]
    split = split_table(rows)
    if split:
        parts.append("## Where Ember's turns went (s)\n\n" + split)
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    # A turn here adds ~500 tokens (a ~300-token excerpt or test output, the
    # question, a 64-token answer): 15 turns reach ~7.8k of SmolLM2's 8k
    # context, and a 16th is refused as too long (the 27 turns added
    # ~260 tokens each).
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--restart-at", type=int, help="restart every server before this turn (default: the middle)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--completion", action="store_true", help="a completion session (default for gemma3 models)")
    ap.add_argument("--peers", help="also vllm-mlx and/or rapid-mlx (comma-separated; venvs from --setup-peers)")
    ap.add_argument("--setup-peers", action="store_true", help="create the peers' venvs and exit (heavy download)")
    ap.add_argument("--ember-flags", help="extra `ember serve` flags, e.g. '--draft-model ngram'")
    ap.add_argument(
        "--peer-weights",
        help="the format mlx_lm.server and the peers serve a packaged model in (e.g. float32: MLX's fastest on a "
        "CPU); default: the directory Ember serves",
    )
    ap.add_argument("--no-split", action="store_true", help="skip the attention probe")
    ap.add_argument("--out", help="also write the report (markdown) here")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.setup_peers:
        setup_peers(args.peers.split(",") if args.peers else list(PEER_PINS))
        return 0
    rows = run_session(args)
    if not args.no_split:
        from engine.models import resolve_model

        add_splits(rows, resolve_model(args.model))
    text = report(rows, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([t.__dict__ for t in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
