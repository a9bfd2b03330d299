"""What this machine can serve (``ember ls``) and what ``ember rm`` may delete.

Rows come from: the bundled and packaged names, huggingface_hub's cache
(``scan_cache_dir``), Ember's converted GGUFs (``~/.cache/ember/gguf`` or
``$EMBER_CACHE_DIR/gguf``) and LM Studio's models folder. Each row says the
name ``--model`` takes, where it is, its size on disk, its format (MLX
quantized bits or the safetensors dtype from ``config.json``; a GGUF's quant
tag from its file name) and whether its chat template mentions tools (what a
coding agent needs). Reading never fails the listing: a row it cannot
describe says ``?``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import shutil
from typing import Any

from engine.models import BUNDLED, hub

_QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q\d[A-Za-z0-9_]*|[BF]F?16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


@dataclasses.dataclass
class LocalModel:
    name: str  # what --model takes
    source: str  # bundled, packaged, hub, converted, lmstudio, models-dir
    format: str
    size_bytes: int | None
    tools: bool | None  # the chat template mentions tools; None: no template read
    path: str

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _size(path: pathlib.Path) -> int | None:
    with contextlib.suppress(OSError):
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return None


def _template(path: pathlib.Path) -> str | None:
    """The chat template text of an mlx-lm / transformers directory."""
    with contextlib.suppress(OSError):
        return (path / "chat_template.jinja").read_text()
    with contextlib.suppress(OSError, ValueError):
        tmpl = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
            return " ".join(str(t.get("template", "")) for t in tmpl if isinstance(t, dict))
        return tmpl if isinstance(tmpl, str) else None
    return None


def dir_format(path: pathlib.Path) -> str:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(cfg.get("ember_gguf"), dict):
        return f"gguf→mlx {cfg['ember_gguf'].get('dtype', '?')}"
    if isinstance(quant, dict) and quant.get("bits"):
        return f"mlx {quant['bits']}-bit"
    return f"safetensors {cfg.get('torch_dtype') or cfg.get('dtype') or '?'}"


def gguf_tag(path: pathlib.Path) -> str | None:
    m = _QUANT_TAG.search(path.stem)
    return m.group(1).upper() if m else None


def _gguf_tools(path: pathlib.Path) -> bool | None:
    """Whether the GGUF's own chat template (its metadata) mentions tools."""
    try:
        import gguf
    except ImportError:  # the `models` extra: without it a GGUF's template is "?"
        return None
    with contextlib.suppress(Exception):  # an unreadable file is "?" too
        field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
        return None if field is None else "tools" in str(field.contents())
    return None


def describe(path: pathlib.Path, name: str, source: str, size: int | None = None) -> LocalModel:
    if path.is_file():
        tag = gguf_tag(path)
        return LocalModel(name, source, f"gguf {tag or '?'}", size or _size(path), _gguf_tools(path), str(path))
    tmpl = _template(path)
    return LocalModel(
        name, source, dir_format(path), size or _size(path), None if tmpl is None else "tools" in tmpl, str(path)
    )


def _gguf_rows(root: pathlib.Path, repo_id: str, source: str) -> list[LocalModel]:
    files = sorted(p for p in root.rglob("*.gguf") if p.is_file())
    rows = []
    for f in files:
        tag = gguf_tag(f)
        name = f"{repo_id}:{tag}" if tag and len(files) > 1 else repo_id
        rows.append(describe(f, name, source))
    return rows


def hub_rows() -> list[LocalModel]:
    rows: list[LocalModel] = []
    with contextlib.suppress(Exception):  # a cache it cannot scan lists nothing
        for repo in hub.cached_repos():
            revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
            if not revs:
                continue
            snap = pathlib.Path(revs[0].snapshot_path)
            if hub.is_mlx_dir(snap):
                rows.append(describe(snap, repo.repo_id, "hub", repo.size_on_disk))
            else:
                rows += _gguf_rows(snap, repo.repo_id, "hub")
    return rows


def lmstudio_rows() -> list[LocalModel]:
    rows: list[LocalModel] = []
    for root in hub.lmstudio_roots():
        for d in sorted(root.glob("*/*")) if root.is_dir() else ():
            if not d.is_dir():
                continue
            repo_id = f"{d.parent.name}/{d.name}"
            if hub.is_mlx_dir(d):
                rows.append(describe(d, repo_id, "lmstudio"))
            else:
                rows += _gguf_rows(d, repo_id, "lmstudio")
    return rows


def converted_rows() -> list[LocalModel]:
    from engine.mlx.gguf_convert import cache_root

    root = cache_root()
    dirs = sorted(p for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []
    return [describe(d, str(d), "converted") for d in dirs]


def packaged_rows() -> list[LocalModel]:
    from engine.mlx.gguf_models import PACKAGED, installed

    rows = [describe(path, name, "bundled") for name, path in BUNDLED.items() if path.is_dir()]
    for name, spec in PACKAGED.items():
        if installed(name):
            rows.append(LocalModel(name, "packaged", "gguf (converted on first use)", None, None, spec.dist))
    return rows


def list_models() -> list[LocalModel]:
    """Every model this machine can serve without downloading, source by source."""
    return packaged_rows() + hub_rows() + converted_rows() + lmstudio_rows()


def converted_from(gguf: pathlib.Path) -> list[pathlib.Path]:
    """The converted directories made from one GGUF file, in every dtype."""
    from engine.mlx.gguf_convert import DTYPES, cache_root, file_key

    out = []
    with contextlib.suppress(OSError):
        for dtype in DTYPES:
            target = cache_root() / f"{gguf.stem}-{file_key(gguf, dtype)}"
            if target.is_dir():
                out.append(target)
    return out


def removal(name: str) -> tuple[str, list[pathlib.Path], int]:
    """What ``ember rm NAME`` deletes: ("hub", the converted dirs of its GGUFs, bytes)
    for a hub-cache repo, ("converted", [dir], bytes) for a converted directory.
    HubError naming why when NAME is not something Ember may delete."""
    from engine.mlx.gguf_convert import cache_root

    ref = hub.parse(name)
    if ref is not None:
        repo = next((r for r in hub.cached_repos() if r.repo_id == ref.repo_id), None)
        if repo is not None:
            ggufs = [p for rev in repo.revisions for p in pathlib.Path(rev.snapshot_path).rglob("*.gguf")]
            conv = [d for g in ggufs for d in converted_from(g)]
            return "hub", conv, repo.size_on_disk + sum(_size(d) or 0 for d in conv)
    path = pathlib.Path(name).expanduser()
    if not path.is_absolute():
        path = cache_root() / name
    root = cache_root().resolve()
    if path.is_dir() and path.resolve().parent == root and (path / "config.json").is_file():
        return "converted", [path], _size(path) or 0
    if name in BUNDLED:
        raise hub.HubError(f"{name} ships with Ember; there is nothing to remove")
    if ref is not None and hub.lmstudio_path(ref) is not None:
        raise hub.HubError(f"{name} is LM Studio's copy; remove it in LM Studio")
    raise hub.HubError(f"{name} is neither in the hub cache ({hub.hub_cache()}) nor a converted GGUF in {root}")


def remove(name: str) -> int:
    """Delete what ``removal(name)`` names; the bytes freed."""
    kind, dirs, size = removal(name)
    if kind == "hub":
        ref = hub.parse(name)
        assert ref is not None
        hub.remove(ref.repo_id)
    for d in dirs:
        shutil.rmtree(d)
    return size
