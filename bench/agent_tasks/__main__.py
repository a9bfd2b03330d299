"""Agents finishing real tasks through Ember, judged by the file system (issue #41).

    python -m bench.agent_tasks [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
        [--clients claude,codex,opencode] [--tasks hello,command,fix,rename,secret]
        [--task-timeout 600] [--max-output-tokens 512] [--out docs/bench/agent-tasks.md]
    python -m bench.agent_tasks --models scripted     # the harness checks itself: a model that solves every task

Each task is a throwaway git repository and a short prompt; Claude Code (``claude -p``), Codex CLI
(``codex exec``) and OpenCode (``opencode run``), unmodified, are started through ``ember launch
CLIENT`` and choose their own tool calls. One ``ember serve`` per model serves every session, behind
a recording proxy (bench/agent_tasks/wire.py) that logs what crossed the wire; a failed task is
attributed to the model's choice or to Ember's fault (bench/agent_tasks/attribute.py). The clients
are found in ``$EMBER_AGENT_BIN`` (``--agent-bin``), else on PATH. Exit status 1 when Ember faulted
anywhere, 2 when nothing could run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile

from bench.agent_tasks.attribute import Session, judge_session, session_from_dict
from bench.agent_tasks.clients import CLIENTS
from bench.agent_tasks.report import report
from bench.agent_tasks.run import SCRIPTED, ember_server, repo_dir, run_session, write_solving_script
from bench.agent_tasks.tasks import BY_NAME, TASKS, Task, make_repo
from bench.agent_tasks.wire import Proxy
from bench.docs import commit


def find_client(name: str, bin_dir: str | None) -> str | None:
    if bin_dir and (pathlib.Path(bin_dir) / name).is_file():
        return str(pathlib.Path(bin_dir) / name)
    return shutil.which(name)


def run_model(
    model: str,
    clients: dict[str, str],
    tasks: list[Task],
    run_dir: pathlib.Path,
    max_output: int,
    timeout_s: float,
) -> list[Session]:
    """Every task of every client on one ``ember serve --model MODEL`` behind one proxy."""
    plan = [(c, t, repo_dir(run_dir, model, c, t)) for c in clients for t in tasks]
    for _, t, repo in plan:
        make_repo(t, repo)
    served = model
    if model == SCRIPTED:
        served = f"scripted:{write_solving_script(run_dir / 'script.json', plan)}"
    sessions = []
    with ember_server(served, run_dir, max_output) as url, Proxy(url) as proxy:
        for client, task, repo in plan:
            print(f"[agent_tasks] {client} / {model} / {task.name} ...", file=sys.stderr, flush=True)
            label = pathlib.Path(model).name if os.sep in model else model  # a model directory by its name
            s = run_session(client, clients[client], task, served, repo, proxy, max_output, timeout_s, label)
            verdict = "pass" if s.passed else f"FAIL, {s.outcome}: {s.reason or '; '.join(s.ember)}"
            print(
                f"[agent_tasks]   {verdict}; turns {s.turns}, calls {s.tool_calls}, prompt {s.prompt_tokens}, "
                f"cached {s.cached_tokens}, {s.wall_s:.0f} s, exit {s.exit_code}; ember faults {len(s.ember)}",
                file=sys.stderr,
                flush=True,
            )
            if not s.passed or s.ember:
                print("[agent_tasks]   client output: " + s.output_tail[-1500:], file=sys.stderr, flush=True)
            sessions.append(s)
    return sessions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b", help="`ember serve --model` values")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--tasks", default=",".join(t.name for t in TASKS))
    ap.add_argument("--task-timeout", type=float, default=600.0, metavar="SECONDS", help="wall-clock cap per session")
    ap.add_argument("--max-output-tokens", type=int, default=512, help="each client's reply budget per turn")
    ap.add_argument("--agent-bin", default=os.environ.get("EMBER_AGENT_BIN"), help="folder of the client executables")
    ap.add_argument("--keep", metavar="DIR", help="keep the repositories and homes here (default: a temp folder)")
    ap.add_argument("--out", help="also write the Markdown report here")
    ap.add_argument("--json", help="also write every session with what crossed the wire here")
    ap.add_argument("--from-json", metavar="FILE", help="run nothing: attribute and report a run --json saved")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(pathlib.Path(args.from_json).read_text())
        again = [judge_session(session_from_dict(d)) for d in saved["sessions"]]
        text = report(again, saved["header"] + f" _Attributed again from `{args.from_json}`._")
        print(text)
        if args.out:
            pathlib.Path(args.out).write_text(text)
        return 1 if any(s.ember for s in again) else 0
    unknown = [t for t in args.tasks.split(",") if t not in BY_NAME]
    if unknown:
        ap.error(f"--tasks: unknown {', '.join(unknown)} (known: {', '.join(BY_NAME)})")
    tasks = [BY_NAME[t] for t in args.tasks.split(",")]
    clients = {}
    for name in args.clients.split(","):
        if name not in CLIENTS:
            ap.error(f"--clients: unknown {name} (known: {', '.join(CLIENTS)})")
        exe = find_client(name, args.agent_bin)
        if exe is None:
            print(
                f"[agent_tasks] skipping {name}: not installed (--agent-bin / $EMBER_AGENT_BIN / PATH)", file=sys.stderr
            )
        else:
            clients[name] = exe
    if not clients:
        print("[agent_tasks] no client to run", file=sys.stderr)
        return 2
    sha = commit()
    load0 = os.getloadavg()[0]
    sessions: list[Session] = []
    with tempfile.TemporaryDirectory(prefix="ember-agent-tasks-") as tmp:
        base = pathlib.Path(args.keep or tmp)
        for i, model in enumerate(args.models.split(",")):
            sessions += run_model(model, clients, tasks, base / f"m{i}", args.max_output_tokens, args.task_timeout)
    command = "python -m bench.agent_tasks " + shlex.join(sys.argv[1:] if argv is None else argv)
    header = (
        f"_`{command}` at commit `{sha}` on {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"load {load0:.2f} → {os.getloadavg()[0]:.2f} (1-min `os.getloadavg()`, before → after)._"
    )
    text = report(sessions, header)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    if args.json:
        saved = {"header": header, "sessions": [dataclasses.asdict(s) for s in sessions]}
        pathlib.Path(args.json).write_text(json.dumps(saved, indent=1))
    return 1 if any(s.ember for s in sessions) else 0


if __name__ == "__main__":
    sys.exit(main())
