"""The serve install brings no torch (issue #44): it cost 2.6 s of every ``ember serve`` start
when the embedding model's package pulled sentence-transformers.

Two checks. The install: ``ember-mlx[models]``, with every requirement it pulls in as installed
here, names neither torch nor sentence-transformers. The start: ``ember serve`` imports no
sentence-transformers even where the test extra installed it; torch it imports only where it
is installed, and then only through transformers (mlx-lm's tokenizers import transformers,
whose ``modeling_rope_utils`` imports torch whenever it can: 1.2-1.7 s here; transformers 5 has
no switch to stop it), which a serve-only environment does not have."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess

import httpx
from packaging.requirements import Requirement

from sims.live.server import read_url, serve_command, stop

HEAVY = {"torch", "sentence-transformers"}


def _closure(dist: str, extras: set[str]) -> set[str]:
    """Distribution names ``dist[extras]`` requires, transitively, as installed here."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, ex = todo.pop()
        try:
            reqs = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue  # an optional requirement not installed here pulls nothing here
        for line in reqs:
            req = Requirement(line)
            env = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
                continue
            key = re.sub(r"[-_.]+", "-", req.name).lower()
            if key not in seen:
                seen.add(key)
                todo.append((key, set(req.extras)))
    return seen


def test_the_serve_install_requires_no_torch():
    pulled = _closure("ember-mlx", {"models"})
    assert {"mlx", "mlx-lm", "gguf"} <= pulled  # the walk reads the real metadata
    assert not pulled & HEAVY, sorted(pulled & HEAVY)
    assert {"torch", "sentence-transformers"} <= _closure("ember-mlx", {"test"})  # the walk sees them where they are


def _importers(log: str, module: str) -> list[str]:
    """The top-level modules under which ``module`` was first imported (Python's import log
    lists a module's imports before it, one indentation step deeper)."""
    rows = [line.split("|")[-1] for line in log.splitlines() if line.startswith("import time:") and "|" in line]
    chain: list[str] = []
    for i, row in enumerate(rows):
        if row.strip() == module:
            depth = len(row) - len(row.lstrip())
            for later in rows[i + 1 :]:
                d = len(later) - len(later.lstrip())
                if d < depth:
                    chain.append(later.strip())
                    depth = d
            break
    return chain


def test_ember_serve_imports_no_sentence_transformers_and_torch_only_through_transformers(tmp_path):
    log = tmp_path / "imports.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPROFILEIMPORTTIME": "1"}
    argv = serve_command("--model", "tiny", "--host", "127.0.0.1")
    with log.open("w") as err:  # a file, not a pipe: the import log is far larger than a pipe's buffer
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            url = read_url(proc, 120)
            assert url is not None, log.read_text()[-2000:]
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            stop(proc)
    text = log.read_text()
    imported = {line.split("|")[-1].strip() for line in text.splitlines() if line.startswith("import time:")}
    assert "mlx.core" in imported and "starlette" in imported  # the log is the server's own
    assert "sentence_transformers" not in imported
    if "torch" in imported:
        chain = _importers(text, "torch")
        assert chain and chain[0].startswith("transformers."), chain
