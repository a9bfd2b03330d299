"""docs/http.md's flag tables say what ``ember serve`` does (issue #44 item 4).

Each serve flag's effective default is computed from the code: the parser's
default, or, where the parser leaves it to the config (``None``), the value in
the ``EngineConfig`` that ``engine_config`` builds for a plain ``ember serve``
(so serve's own choices count: prompt lookup, the prefill share, the SSD tier).
The row of docs/http.md naming the flag must state that value in its default
cell. A value of None is stated by the word the docs use for what it means
there (``MEANS``). A serve flag with no row fails too.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from ember.ssd_tier import DEFAULT_CAP_GIB, demote_idle_s
from transport import cli

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "http.md"

# what a None default means, in the docs' words, where it is not simply "off"/"none"
MEANS = {
    "--num-draft-tokens": "adaptive",
    "--attention-streams": "one per core",
    "--served-model-name": "the `--model` value",
    "--models-dir": "under the cache root",
}
# flags whose default is no single value, each with what its row must say instead
DERIVED = {
    "--ssd-cache-max": f"min({DEFAULT_CAP_GIB:g} GiB, 10% of free space)",  # measured at start
    "--no-ssd-cache": "--no-ssd-cache",  # the off switch of the SSD row
}


def rows() -> list[tuple[str, str]]:
    """(flags cell, default cell) of every table row of docs/http.md."""
    out = []
    for line in DOC.read_text().splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            out.append((cells[0], cells[-1]))
    return out


def row_of(flag: str) -> str | None:
    for flags, default in rows():
        if re.search(rf"`{re.escape(flag)}[ `=]", flags):
            return default
    return None


def serve_parser() -> argparse.ArgumentParser:
    return cli.build_parser().parse_args(["serve"]).parser


def word(value: object) -> str | tuple[str, ...]:
    if value is True:
        return "on"
    if value is None or value is False or value == []:
        return ("off", "none")
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def serve_flags() -> list[argparse.Action]:
    return [
        a
        for a in serve_parser()._actions
        if a.option_strings and a.help != argparse.SUPPRESS and a.dest not in ("help", "run", "parser")
    ]


@pytest.fixture(scope="module")
def serve_config(tmp_path_factory: pytest.TempPathFactory) -> object:
    mp = pytest.MonkeyPatch()
    mp.delenv("EMBER_API_KEY", raising=False)  # --api-key's default reads it
    try:
        args = cli.build_parser().parse_args(["serve"])
        return cli.engine_config(args, args.parser), args
    finally:
        mp.undo()


def expected(action: argparse.Action, config: object) -> str | tuple[str, ...]:
    flag = action.option_strings[0]
    if flag in DERIVED:
        return DERIVED[flag]
    field = cli.ENGINE_FIELDS.get(action.dest, action.dest)
    if flag == "--fake-gpu":
        return config.backend  # type: ignore[attr-defined]
    if flag == "--ssd-cache":
        return word(bool(config.ssd_cache_dir))  # type: ignore[attr-defined]  # a folder per model: "on"
    if flag == "--ssd-demote-idle":
        return f"{demote_idle_s(config):g} s"  # type: ignore[arg-type]
    value = getattr(config, field) if hasattr(config, field) and action.default is None else action.default
    if value is None and flag in MEANS:
        return MEANS[flag]
    return word(value)


@pytest.mark.parametrize("action", serve_flags(), ids=lambda a: a.option_strings[0])
def test_docs_http_states_each_serve_flags_default(action: argparse.Action, serve_config) -> None:
    config, _ = serve_config
    flag = action.option_strings[0]
    cell = next((c for c in map(row_of, action.option_strings) if c is not None), None)  # --x or --no-x
    assert cell is not None, f"docs/http.md has no table row for {flag}"
    want = expected(action, config)
    options = (want,) if isinstance(want, str) else want
    assert any(o.lower() in cell.lower() for o in options), f"{flag}: the code's default is {want!r}; docs say {cell!r}"


def test_the_checked_defaults_are_the_code_s() -> None:
    # the check reads the parser and the config, not copies: a changed default changes what it wants
    config = cli.engine_config(*(lambda a: (a, a.parser))(cli.build_parser().parse_args(["serve", "--batch", "3"])))
    batch = next(a for a in serve_flags() if a.option_strings[0] == "--batch")
    assert expected(batch, config) == "3"
