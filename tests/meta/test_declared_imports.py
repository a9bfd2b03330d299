"""Every third-party import is declared by the extras of the command that runs it.

A module counts as declared only by what its own command installs (README,
CONTRIBUTING.md): ``ember serve`` the core ``dependencies``; ``python -m
bench.X`` / ``python -m sims.X`` the ``bench`` extra; the gateway commands
(``sims.live.replicas``, ``bench.serve.affinity``) the ``cluster`` extra; ``python -m
tools.X`` the ``train`` extra; ``pytest`` the ``test`` extra. So ``pip install
-e ".[bench]" && python -m bench.serve.vs_mlx_lm`` cannot fail on a module only the
test extra brings.

An import inside ``try: ... except ImportError`` is an optional one (the
fallback says which extra to install); if the command's extras declare it
anyway, the fallback is dead code and fails here too.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIRST_PARTY = {"ember", "engine", "actors", "transport", "sims", "bench", "tools", "tests"}
PROJECT = "ember-mlx"

# The extras each command installs, by module prefix (the longest prefix wins).
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "ember": (),
    "engine": (),
    "actors": (),
    "transport": (),
    "sims": ("bench",),
    "bench": ("bench",),
    "sims.live.replicas": ("cluster",),  # pip install -e ".[cluster]" (README, docs/distributed.md)
    "bench.serve.affinity": ("cluster",),
    "tools": ("train",),
    "tests": ("test",),
    # `ember serve --model smollm2-135m | FILE.gguf`: the README's install line has `.[models]`
    "engine.mlx.gguf_convert": ("models",),
}

# Import names that differ from their distribution's name, as pyproject.toml
# declares them for dependency checkers ([tool.deptry.package_module_name_map]).
IMPORT_NAMES: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["deptry"][
    "package_module_name_map"
]

# Guarded imports kept on purpose although the command declares them, each with its reason.
KEPT_FALLBACKS: dict[tuple[str, str], str] = {
    # tests ask it whether to skip the gateway tests (`pytest -m cluster` installs the extra)
    (
        "sims.live.replicas",
        "sglang_router",
    ): "router_available() is the skip condition of tests/sims/test_cluster_gateway.py",
    # `ember serve --model FILE.gguf` without the models extra: a clear message names it
    ("engine.mlx.gguf_convert", "gguf"): "_require_gguf() explains how to install the models extra",
    ("engine.mlx.gguf_convert", "transformers"): "a transformers without GGUF support is named in the error",
    # helper anth removes this one (transport/turn/tools.py, issue #31)
    ("transport.turn.tools", "llguidance"): "being removed in transport/turn/tools.py by its owner",
}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared(extras: tuple[str, ...]) -> set[str]:
    """Distribution names the core dependencies plus ``extras`` (followed through
    ``ember-mlx[...]`` self-references) install, directly."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    names = {_requirement_name(r) for r in project["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            name = _requirement_name(req)
            if name == PROJECT:
                todo += re.findall(r"[\w-]+", req.split("[", 1)[1].split("]", 1)[0])
            else:
                names.add(name)
    return names


@functools.cache
def _installed_import_names() -> dict[str, frozenset[str]]:
    by_dist: dict[str, set[str]] = {}
    for top, ds in importlib.metadata.packages_distributions().items():
        for d in ds:
            by_dist.setdefault(d.lower().replace("_", "-"), set()).add(top)
    return {d: frozenset(tops) for d, tops in by_dist.items()}


def _import_names(dists: set[str]) -> set[str]:
    by_dist = _installed_import_names()
    out: set[str] = set()
    for d in dists:
        out |= by_dist.get(d, set())
        out.add(IMPORT_NAMES.get(d, d.replace("-", "_")))
    return out


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _extras_for(module: str) -> tuple[str, ...]:
    best = max((p for p in COMMAND_EXTRAS if module == p or module.startswith(p + ".")), key=len)
    return COMMAND_EXTRAS[best]


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a ``try`` that catches ImportError."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            for n in ast.walk(h.type) if h.type is not None else ():
                if isinstance(n, ast.Name):
                    caught.add(n.id)
        if caught & {"ImportError", "ModuleNotFoundError"}:
            for stmt in node.body:
                out |= {id(n) for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return out


def third_party_imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, guarded) for each third-party import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    guarded = _guarded(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in FIRST_PARTY and top not in sys.stdlib_module_names and top != "__future__":
                out.append((top, node.lineno, id(node) in guarded))
    return out


def problems(root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for pkg in sorted(p for p in FIRST_PARTY if (root / p).is_dir()):
        for path in sorted((root / pkg).rglob("*.py")):
            module = _module_name(path)
            extras = _extras_for(module)
            declared = _import_names(_declared(extras))
            for top, line, guarded in third_party_imports(path):
                where = f"{path.relative_to(root)}:{line}"
                command = f"the {' + '.join(extras)} extra" if extras else "the core dependencies"
                if not guarded and top not in declared:
                    found.append(f"{where}: imports {top}, which {command} does not declare")
                elif guarded and top in declared and (module, top) not in KEPT_FALLBACKS:
                    found.append(f"{where}: an ImportError fallback for {top}, which {command} declares (dead code)")
    return found


def test_every_import_is_declared_by_the_extras_its_command_installs():
    assert problems() == []


def test_the_check_counts_only_the_commands_extras(tmp_path, monkeypatch):
    """A bench module importing what only `test` declares is reported; so is a
    dead fallback for a core dependency."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("import hypothesis\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "y.py").write_text("try:\n    import msgspec\nexcept ImportError:\n    msgspec = None\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert problems(tmp_path) == [
        "bench/x.py:1: imports hypothesis, which the bench extra does not declare",
        "engine/y.py:2: an ImportError fallback for msgspec, which the core dependencies declares (dead code)",
    ]
