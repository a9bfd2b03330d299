"""How each agent client is run on a task: unmodified, through ``ember launch CLIENT``.

Only the clients' own flags and environment variables are used, the ones a user would:

- **Claude Code** ``claude -p PROMPT``: a small tool set (``--tools``; its full set and system prompt
  are ~20k tokens, too much prefill for a small model on a CPU), those tools pre-approved
  (``--allowedTools``: a ``-p`` session cannot ask), and its reply budget
  (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, which launch keeps).
- **Codex CLI** ``codex exec``: ``-s workspace-write`` (exec is read-only unless told it may edit). Its
  requests carry no output limit (0.171.0 has no setting for it: seen through the proxy), so the
  harness serves with ``--default-max-tokens``.
- **OpenCode** ``opencode run --auto`` (permissions approved: a run cannot ask) and its reply budget as
  the model's ``limit.output`` in ``OPENCODE_CONFIG_CONTENT``, which OpenCode merges over the config
  file launch writes.

``scripted_call`` is the tool call that does a task with the client's own shell tool: what the scripted
model answers when the harness checks itself.
"""

from __future__ import annotations

import json
from typing import Any

from bench.agent_tasks.tasks import Task

CLIENTS = ("claude", "codex", "opencode")
CLAUDE_TOOLS = "Bash,Read,Write,Edit"


def client_args(client: str, task: Task) -> list[str]:
    """The client's own arguments (after ``ember launch CLIENT ... --``)."""
    if client == "claude":
        return ["-p", task.prompt, "--tools", CLAUDE_TOOLS, "--allowedTools", CLAUDE_TOOLS]
    if client == "codex":
        return ["exec", "-s", "workspace-write", task.prompt]
    if client == "opencode":
        return ["run", "--auto", task.prompt]
    raise ValueError(f"unknown client {client!r} ({', '.join(CLIENTS)})")


def client_env(client: str, model: str, context: int, max_output: int) -> dict[str, str]:
    """What the client reads from its environment beyond what launch sets: its reply budget."""
    if client == "claude":
        return {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output)}
    if client == "opencode":
        limit = {"context": context, "output": max_output}
        config = {"provider": {"ember": {"models": {model: {"name": model, "limit": limit}}}}}
        return {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    return {}


def scripted_call(client: str, task: Task) -> tuple[str, dict[str, Any]]:
    """(tool, arguments): the client's shell tool running the task's solution."""
    if client == "claude":
        return "Bash", {"command": task.solve, "description": "Do the task"}
    if client == "codex":
        return "exec_command", {"cmd": task.solve}
    if client == "opencode":
        return "bash", {"command": task.solve, "description": "Do the task"}
    raise ValueError(f"unknown client {client!r} ({', '.join(CLIENTS)})")
