"""Running the sessions: one ``ember serve`` per model behind the recording proxy, then every task
of every client through ``ember launch CLIENT --port PROXY`` (which reuses the server answering
there), one session at a time, so the server's prompt cache stays warm across sessions and the
proxy's log splits cleanly into sessions.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from bench.agent_tasks.attribute import Session, judge_session
from bench.agent_tasks.clients import client_args, client_env, scripted_call
from bench.agent_tasks.tasks import Task, make_repo
from bench.agent_tasks.wire import Proxy
from transport.server.launch import served_model, start_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTED = "scripted"  # --models scripted: the harness checks itself with a model that solves every task


def repo_dir(run_dir: pathlib.Path, model: str, client: str, task: Task) -> pathlib.Path:
    return run_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", model) / client / task.name / "repo"


def write_solving_script(path: pathlib.Path, sessions: Sequence[tuple[str, Task, pathlib.Path]]) -> pathlib.Path:
    """The scripted model (engine.fake.scripted) that does each session's task: the session is told
    apart by its repository's path, which every client puts in its prompt (its working directory)."""
    rules = []
    for client, task, repo in sessions:
        tool, arguments = scripted_call(client, task)
        where = re.escape(str(repo))
        rules += [
            {
                "tools": True,
                "prompt": where,
                "tool_results": 0,
                "text": "",
                "tool_calls": [{"name": tool, "arguments": arguments}],
            },
            {"tools": True, "prompt": where, "min_tool_results": 1, "text": "Done."},
        ]
    path.write_text(json.dumps({"rules": rules, "default": "OK."}))
    return path


@contextlib.contextmanager
def ember_server(model: str, run_dir: pathlib.Path, max_output: int) -> Iterator[str]:
    """``ember serve --model MODEL`` on a free port (its SSD tier in the run's folder); its URL.
    ``--default-max-tokens``: Codex sends no output limit (0.171.0 has no setting for one), so
    the reply budget of its turns is the server's default."""
    args = ["--model", model, "--ssd-cache", str(run_dir / "ssd"), "--log-level", "warning"]
    args += ["--default-max-tokens", str(max_output)]
    proc, url = start_server(args, 0)
    # start_server read stdout up to the URL; drain the rest so a chatty server never blocks on a full pipe
    drain = threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True)
    drain.start()
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        drain.join(10)
        if proc.stdout is not None:
            proc.stdout.close()


def session_env(home: pathlib.Path, extra: dict[str, str]) -> dict[str, str]:
    """Only what a client needs, with its own HOME and cache (nothing of the user's). This interpreter's
    folder leads PATH (the model's ``python3 -m pytest`` finds pytest); PYTHONPATH lets ``python -m
    transport.cli`` import this checkout from the task's repository."""
    home.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
    return {
        "PATH": path,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def _run_capped(
    argv: list[str], env: dict[str, str], cwd: pathlib.Path, timeout_s: float
) -> tuple[int | None, str, bool]:
    """(exit code, output tail, timed out): the whole process group is stopped at the cap."""
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out[-4000:], False
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, _ = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out = ""
        return None, (out or "")[-4000:], True


def run_session(
    client: str,
    exe: str,
    task: Task,
    model: str,
    repo: pathlib.Path,
    proxy: Proxy,
    max_output: int,
    timeout_s: float,
    label: str | None = None,
) -> Session:
    """One client on one task through ``ember launch``; judged by the repository afterwards."""
    found = served_model(proxy.url)
    if found is None:
        raise RuntimeError(f"nothing answers /v1/models at the proxy {proxy.url}")
    served, context = found
    if not repo.exists():
        make_repo(task, repo)
    env = session_env(repo.parent / "home", client_env(client, served, context or 8192, max_output))
    argv = [sys.executable, "-m", "transport.cli", "launch", client, "--model", model]
    argv += ["--port", str(proxy.port), "--bin", exe, "--", *client_args(client, task)]
    mark = proxy.recorder.mark()
    t0 = time.monotonic()
    code, tail, timed_out = _run_capped(argv, env, repo, timeout_s)
    wall = time.monotonic() - t0
    exchanges = proxy.recorder.since(mark)
    deadline = time.monotonic() + 10  # a killed client's last answer settles in the proxy
    while any(ex.t_end is None for ex in exchanges) and time.monotonic() < deadline:
        time.sleep(0.1)
    passed, detail = task.judge(repo)
    session = Session(
        client, label or model, task.name, passed, detail, code, timed_out, wall, exchanges, output_tail=tail
    )
    return judge_session(session)
