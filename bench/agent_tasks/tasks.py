"""The tasks: each a throwaway git repository, a short explicit prompt, and a judge that reads the
file system afterwards (never the transcript).

A judge returns ``(passed, detail)``; it runs what the task names (the script, pytest, the
renamed import) with this interpreter, in the repository, under a time cap. ``solve`` is the
shell command that does the task: the scripted model's answer when the harness checks itself
(``--model scripted``), and the tests' proof that every judge can pass (and, on the untouched
repository, fail).
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

SECRET = "PAPAYA-7731"
Judge = Callable[[pathlib.Path], tuple[bool, str]]


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    files: dict[str, str]  # the repository's committed files
    judge: Judge
    solve: str  # a shell command, run in the repository, that does the task


def _run(repo: pathlib.Path, *argv: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, cwd=repo, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", "timed out after 60 s")


def _read(repo: pathlib.Path, name: str) -> str | None:
    try:
        return (repo / name).read_text(errors="replace")
    except OSError:
        return None


def _short(s: str, n: int = 80) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _judge_hello(repo: pathlib.Path) -> tuple[bool, str]:
    if not (repo / "hello.py").is_file():
        return False, "no hello.py"
    r = _run(repo, sys.executable, "hello.py")
    ok = r.returncode == 0 and r.stdout.strip() == "hello world"
    return ok, f"hello.py printed {_short(r.stdout)!r} (exit {r.returncode})"


def _judge_answer(expected: str) -> Judge:
    def judge(repo: pathlib.Path) -> tuple[bool, str]:
        text = _read(repo, "answer.txt")
        if text is None:
            return False, "no answer.txt"
        return text.strip() == expected, f"answer.txt holds {_short(text)!r}"

    return judge


_TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
_TEST_CALC_SHA = hashlib.sha256(_TEST_CALC.encode()).hexdigest()


def _judge_fix(repo: pathlib.Path) -> tuple[bool, str]:
    test = _read(repo, "test_calc.py") or ""
    if hashlib.sha256(test.encode()).hexdigest() != _TEST_CALC_SHA:
        return False, "test_calc.py was changed (the bug is in calc.py)"
    r = _run(repo, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_calc.py")
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return r.returncode == 0, f"pytest: {_short(last)} (exit {r.returncode})"


_OLD_NAME = re.compile(r"\barea\b")


def _judge_rename(repo: pathlib.Path) -> tuple[bool, str]:
    for name in ("geometry.py", "main.py"):
        text = _read(repo, name)
        if text is None:
            return False, f"{name} is gone"
        if _OLD_NAME.search(text):
            return False, f"{name} still says `area`"
        if "rect_area" not in text:
            return False, f"{name} does not say `rect_area`"
    r = _run(repo, sys.executable, "main.py")
    if r.returncode != 0 or r.stdout.strip() != "12":
        return False, f"main.py printed {_short(r.stdout + r.stderr)!r} (exit {r.returncode})"
    r = _run(repo, sys.executable, "-c", "from geometry import rect_area; assert rect_area(2, 5) == 10")
    return r.returncode == 0, "rect_area imports and computes" if r.returncode == 0 else _short(r.stderr)


TASKS: tuple[Task, ...] = (
    Task(
        name="hello",
        prompt='Create a file hello.py that prints exactly "hello world".',
        files={"README.md": "A scratch repository.\n"},
        judge=_judge_hello,
        solve="printf 'print(\"hello world\")\\n' > hello.py",
    ),
    Task(
        name="command",
        prompt='Run the command `python3 -c "print(6*7)"` and write its output into answer.txt.',
        files={"README.md": "A scratch repository.\n"},
        judge=_judge_answer("42"),
        solve='python3 -c "print(6*7)" > answer.txt',
    ),
    Task(
        name="fix",
        prompt="test_calc.py fails. Fix the one-line bug in calc.py so that `python3 -m pytest test_calc.py` passes.",
        files={"calc.py": "def add(a, b):\n    return a - b\n", "test_calc.py": _TEST_CALC},
        judge=_judge_fix,
        solve="sed -i 's/a - b/a + b/' calc.py",
    ),
    Task(
        name="rename",
        prompt="Rename the function `area` to `rect_area` in geometry.py and in main.py.",
        files={
            "geometry.py": "def area(w, h):\n    return w * h\n",
            "main.py": "from geometry import area\n\nprint(area(3, 4))\n",
        },
        judge=_judge_rename,
        solve="sed -i 's/\\barea\\b/rect_area/g' geometry.py main.py",
    ),
    Task(
        name="secret",
        prompt="What is the secret word in note.txt? Write the word alone into answer.txt.",
        files={"note.txt": f"Shopping: milk, eggs.\nThe secret word is {SECRET}.\nCall the plumber on Monday.\n"},
        judge=_judge_answer(SECRET),
        solve=f"echo {SECRET} > answer.txt",
    ),
)
BY_NAME = {t.name: t for t in TASKS}


def make_repo(task: Task, repo: pathlib.Path) -> pathlib.Path:
    """The task's throwaway repository: its files, committed (Codex wants a repository to work in)."""
    repo.mkdir(parents=True, exist_ok=False)
    for name, text in task.files.items():
        (repo / name).write_text(text)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "task"], cwd=repo, check=True)
    return repo
