"""Agent-shaped workloads for the speculation benchmarks, on a chat model.

* ``chat``: free-form answers to instructions, through the chat template.
  Nothing to copy: this is where a trained drafter must earn its keep.
* ``edit``: "here is a file, return it with one change". A 135M model does
  not follow that instruction on its own (it answered with prose; the issue
  measured 1.00×), so the answer is *started* for it, completion-style: the
  user turn holds the file and asks for one rename, and the assistant turn is
  prefilled with the code fence and the file's first line with the rename
  applied. From there the model continues the file, and the continuation is
  (mostly) a copy of the input, which is what prompt lookup exploits.
* ``copy``: the issue's input-grounded completion prompt, no chat template:
  a 45-line stdlib file, then ``# file: NAME_copy.py (an exact copy of the
  file above)`` and the file's first 3 lines.
* ``agent``: a three-turn tool-using session. The system prompt declares two
  tools; the model's first turn is a ``read_file`` call (its opening is
  prefilled: a 135M model does not emit the call format reliably), the tool
  answers with the file, the second turn quotes the function under
  discussion from that output, a test failure quoting it comes back, and the
  third turn writes the fixed function. Every turn's prompt is the whole
  session so far, the model's own earlier answers included, so each turn
  quotes earlier output. Turns run one after another, as an agent loop does.

Files are small stdlib modules of this Python (no network, no data files),
and the drafter's training text (tools/train_drafter.py) leaves them out.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, and explain how it works.",
    "What are the main differences between a process and a thread?",
    "Give me five tips for writing readable code.",
    "Explain what a REST API is to someone new to programming.",
    "How do I read a CSV file in Python and compute the average of one column?",
    "Describe how a hash map handles collisions.",
    "Write a short story about a robot learning to paint.",
    "What should I check before deploying a web application to production?",
]

# (file, function name for the agent session, identifier renamed by the edit)
EDIT_FILES = [
    ("colorsys.py", "rgb_to_hsv", ("maxc", "max_c")),
    ("bisect.py", "bisect_right", ("lo", "low")),
    ("fnmatch.py", "filter", ("pat", "pattern")),
    ("sched.py", "enterabs", ("time", "when")),
]

AGENT_SYSTEM = (
    "You are a coding assistant working in a repository. You can call tools by writing "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>. Tools: read_file(path) returns the file; '
    "run_tests(path) runs its tests. Quote code exactly when you discuss it."
)


def stdlib_source(name: str, max_lines: int = 48) -> str:
    """The first ``max_lines`` lines of a stdlib module, from its first def/class."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))), 0)
    return "\n".join(lines[start : start + max_lines]) + "\n"


def function_source(name: str, func: str) -> str:
    text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(text) if ln.startswith(f"def {func}(") or ln.startswith(f"    def {func}("))
    indent = len(text[start]) - len(text[start].lstrip())
    end = start + 1
    while end < len(text) and (not text[end].strip() or len(text[end]) - len(text[end].lstrip()) > indent):
        end += 1
    return "\n".join(text[start:end]).rstrip() + "\n"


def _with_prefill(tokenizer: Any, messages: list[dict[str, str]], prefill: str) -> list[int]:
    """The chat prompt with the assistant's answer started: template + prefill."""
    return list(tokenizer.apply_chat_template(messages)) + tokenizer.encode(prefill)


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS[:n]]


def edit_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for name, _, (old, new) in EDIT_FILES[:n]:
        src = stdlib_source(name)
        ask = f"Here is `{name}`:\n```python\n{src}```\nReturn the whole file with `{old}` renamed to `{new}`."
        first = src.splitlines()[0].replace(old, new)
        out.append(_with_prefill(tokenizer, [{"role": "user", "content": ask}], f"```python\n{first}\n"))
    return out


def copy_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for name, _, _ in EDIT_FILES[:n]:
        src = stdlib_source(name, 45)
        head = "".join(ln + "\n" for ln in src.splitlines()[:3])
        stem = name.removesuffix(".py")
        out.append(
            tokenizer.encode(f"# file: {name}\n{src}\n# file: {stem}_copy.py (an exact copy of the file above)\n{head}")
        )
    return out


@dataclass
class AgentSession:
    """A session's turns, built one at a time from the model's own answers."""

    file: str
    func: str
    messages: list[dict[str, str]]
    turn: int = 0

    TURNS = 3

    def next_prompt(self, tokenizer: Any) -> list[int]:
        if self.turn == 0:
            prefill = '<tool_call>{"name": "read_file", "arguments": {"path": "'
        elif self.turn == 1:
            prefill = f"Here is `{self.func}` from the tool output:\n```python\n"
        else:
            prefill = f"Here is the fixed `{self.func}`:\n```python\n"
        self._prefill = prefill
        return _with_prefill(tokenizer, self.messages, prefill)

    def answered(self, text: str) -> None:
        """Record the model's answer and the tool's reply that the next turn sees."""
        self.messages.append({"role": "assistant", "content": self._prefill + text})
        if self.turn == 0:
            reply = f"<tool_response>\n{stdlib_source(self.file)}</tool_response>"
            self.messages.append({"role": "user", "content": reply + f"\nShow me `{self.func}` exactly as it is."})
        elif self.turn == 1:
            src = function_source(self.file, self.func).splitlines()
            quoted = "\n".join(src[:6])
            self.messages.append(
                {
                    "role": "user",
                    "content": (
                        f"<tool_response>\nFAILED test_{self.func}: AssertionError in\n{quoted}\n</tool_response>\n"
                        f"Fix `{self.func}` and show the whole function."
                    ),
                }
            )
        self.turn += 1


def agent_sessions(n: int) -> list[AgentSession]:
    out = []
    for name, func, _ in EDIT_FILES[:n]:
        task = f"The tests for `{name}` fail in `{func}`. Read the file and fix it."
        out.append(
            AgentSession(name, func, [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}])
        )
    return out
