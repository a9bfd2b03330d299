"""bench.docs: block rewriting, the registry and the provenance header (pure, no benchmark runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import docs
from bench.tables import TABLES, Table

ROOT = Path(__file__).resolve().parents[2]


def test_a_block_is_replaced_and_the_rest_kept():
    text = "intro\n<!-- bench:t -->\nold table\n<!-- /bench:t -->\noutro\n"
    out = docs.replace_block(text, "t", "| new |\n")
    assert out == "intro\n<!-- bench:t -->\n| new |\n<!-- /bench:t -->\noutro\n"
    assert docs.read_block(out, "t") == "| new |"
    assert docs.replace_block(out, "t", "| new |") == out  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "no markers at all",
        "<!-- bench:t -->\nopen only",
        "<!-- /bench:t -->\n<!-- bench:t -->",  # out of order
        "<!-- bench:t -->a<!-- /bench:t --><!-- bench:t -->b<!-- /bench:t -->",  # twice
    ],
)
def test_a_missing_or_broken_marker_fails(text):
    with pytest.raises(docs.BlockError):
        docs.replace_block(text, "t", "x")


def test_another_tables_block_is_not_touched():
    text = "<!-- bench:a -->\nA\n<!-- /bench:a -->\n<!-- bench:ab -->\nAB\n<!-- /bench:ab -->\n"
    out = docs.replace_block(text, "a", "new")
    assert docs.read_block(out, "ab") == "AB"
    assert docs.read_block(out, "a") == "new"


def _fake_table(doc: str) -> Table:
    return Table(name="fake", doc=doc, module="bench.x", args=("--rounds", "5"), quick=("--rounds", "1"), model="tiny")


def test_regenerate_writes_the_header_with_command_commit_load_and_model(tmp_path):
    (tmp_path / "d.md").write_text("# doc\n<!-- bench:fake -->\nstale\n<!-- /bench:fake -->\n")
    seen = []

    def runner(argv):
        seen.append(argv)
        return "| verdict | MET |\n"

    assert docs.regenerate([_fake_table("d.md")], tmp_path, quick=True, runner=runner) == ["fake"]
    assert seen == [["-m", "bench.x", "--rounds", "1"]]  # the quick arguments
    block = docs.read_block((tmp_path / "d.md").read_text(), "fake")
    head, body = block.split("\n\n", 1)
    assert body == "| verdict | MET |"  # the benchmark's output verbatim, nothing picked
    assert "`python -m bench.x --rounds 1`" in head
    assert re.search(r"commit `[0-9a-f]{7,}(\+dirty)?`", head), head
    assert re.search(r"load \d+\.\d\d → \d+\.\d\d", head), head
    assert "model `tiny`" in head and "quick mode" in head and "UTC" in head
    assert "stale" not in block


def test_regenerate_checks_every_marker_before_running_anything(tmp_path):
    (tmp_path / "d.md").write_text("no markers\n")
    ran = []
    with pytest.raises(docs.BlockError):
        docs.regenerate([_fake_table("d.md")], tmp_path, quick=False, runner=ran.append)
    assert ran == []


def test_the_commit_carries_a_dirty_flag():
    sha = docs.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", sha)


def test_every_registered_table_has_its_block_once_and_a_runnable_module():
    import importlib.util

    names = [t.name for t in TABLES]
    assert len(names) == len(set(names))
    for t in TABLES:
        text = (ROOT / t.doc).read_text()
        docs.read_block(text, t.name)  # exactly one pair of markers, in order
        assert importlib.util.find_spec(t.module) is not None, t.module
        assert t.quick != t.args, f"{t.name}: the quick mode must reduce something"


def test_no_doc_has_a_block_the_registry_does_not_know():
    registered = {t.name for t in TABLES}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"<!-- bench:([\w-]+) -->", path.read_text()):
            assert name in registered, f"{path.relative_to(ROOT)}: block {name} is in no registry entry"


def test_list_and_an_unknown_name(capsys):
    assert docs.main(["--list"]) == 0
    assert "bench.cpu.blas" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        docs.main(["--only", "no-such-table"])


def test_every_block_of_one_run_carries_the_commit_it_started_at(tmp_path, monkeypatch):
    """The first block written dirties the tree; the later blocks must not say +dirty because of it."""
    shas = iter(["abc1234", "abc1234+dirty"])
    monkeypatch.setattr(docs, "commit", lambda root=docs.ROOT: next(shas))
    tables = [
        Table(name=n, doc="d.md", module="bench.x", args=(), quick=("-q",), model="big", quick_model="tiny")
        for n in ("a", "b")
    ]
    (tmp_path / "d.md").write_text("".join(f"<!-- bench:{n} -->\n<!-- /bench:{n} -->\n" for n in ("a", "b")))
    docs.regenerate(tables, tmp_path, quick=True, runner=lambda argv: "out")
    text = (tmp_path / "d.md").read_text()
    for n in ("a", "b"):
        head = docs.read_block(text, n)
        assert "commit `abc1234`" in head and "model `tiny`" in head, head
