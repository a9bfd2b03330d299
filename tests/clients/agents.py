"""Helpers for the agent-CLI tests: where the pinned npm clients are, a
scripted ``ember serve`` and each client's off-the-network environment."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

# the pinned releases .ci/run installs; EMBER_AGENT_BIN points at their .bin
PINNED = {
    "claude": "@anthropic-ai/claude-code@2.1.332",
    "codex": "@openai/codex@0.171.0",
    "opencode": "opencode-ai@1.18.33",
}
_DEV_BIN = pathlib.Path("/work/npm/node_modules/.bin")


def agent_bin(name: str) -> str | None:
    """The client's executable: $EMBER_AGENT_BIN/NAME, else the dev install, else PATH."""
    for d in (os.environ.get("EMBER_AGENT_BIN"), _DEV_BIN):
        if d and (pathlib.Path(d) / name).is_file():
            return str(pathlib.Path(d) / name)
    return shutil.which(name)


SECRET = "PAPAYA-7731"


def write_script(path: pathlib.Path, tool: str, arguments: dict) -> pathlib.Path:
    """A script: call ``tool`` once, then answer quoting the tool result."""
    spec = {
        "rules": [
            {
                "tools": True,
                "tool_results": 0,
                "text": "Let me check.",
                "tool_calls": [{"name": tool, "arguments": arguments}],
            },
            {"tools": True, "min_tool_results": 1, "text": "The tool said: {{tool_result}}"},
        ],
        "default": "Note",
    }
    path.write_text(json.dumps(spec))
    return path


def base_env(home: pathlib.Path) -> dict[str, str]:
    """Only what a client needs to run, and its own HOME (nothing of the user's)."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}


def run_client(
    argv: list[str], env: dict[str, str], cwd: pathlib.Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
