"""Hugging Face Hub names: ``ORG/NAME[@REVISION][:QUANT]`` → a local model directory.

    --model mlx-community/Qwen3-4B-4bit          an MLX (safetensors) repo
    --model unsloth/Qwen3-4B-GGUF:Q4_K_M         a GGUF repo and the quant file to take from it

Where a model is looked for, in order, none of which fetches a byte:

1. huggingface_hub's standard cache (``HF_HOME`` / ``HF_HUB_CACHE``), where
   mlx-lm, transformers and ``hf download`` put what they fetched;
2. LM Studio's models folder (``~/.lmstudio/models/ORG/NAME`` or
   ``~/.cache/lm-studio/models/ORG/NAME``).

Only then is it downloaded, with huggingface_hub (``HF_TOKEN``, ``HF_ENDPOINT``
and ``HF_HUB_OFFLINE`` are its own): the files mlx-lm fetches for a model
(``ALLOW_PATTERNS``), never ``*.bin``/``*.pth``/``*.gguf`` of an MLX repo. An
interrupted transfer is resumed by huggingface_hub with a Range request; a file
fetched whose sha256 (LFS) or git hash does not match the blob name the hub gave
it is deleted and the pull fails, so a half or corrupt model is never served.
A GGUF file is converted once by ``engine.mlx.gguf_convert.cached_conversion``.

Every failure is a ``HubError`` whose message is one line a user can act on.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pathlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("ember.hub")

# mlx-lm's own list (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): a model mlx-lm
# downloaded is complete for Ember, and the other way round, so the cache
# check finds it without fetching anything.
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
_NAME = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<rev>[A-Za-z0-9._/-]+?))?(?::(?P<quant>[A-Za-z0-9._-]+))?"
)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class HubError(RuntimeError):
    """A hub model that cannot be had; the message is the one line to show."""


@dataclasses.dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        quant = f":{self.quant}" if self.quant else ""
        return f"{self.repo_id}{rev}{quant}"


def parse(name: str) -> HubRef | None:
    """``name`` as a hub reference, or None when it is not shaped like one.
    The caller checks first that it is not a local path."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    m = _NAME.fullmatch(name)
    if m is None or ".." in m["repo"] or m["repo"].endswith((".gguf", ".json")):
        return None
    return HubRef(m["repo"], m["rev"], m["quant"])


def hub_cache() -> pathlib.Path:
    from huggingface_hub import constants

    return pathlib.Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def lmstudio_roots() -> list[pathlib.Path]:
    """LM Studio's models folders (``ORG/NAME`` directories below): the current
    default and the one older versions used; ``LMSTUDIO_MODELS_DIR`` first if set."""
    roots = [os.environ.get("LMSTUDIO_MODELS_DIR") or "", "~/.lmstudio/models", "~/.cache/lm-studio/models"]
    return [pathlib.Path(r).expanduser() for r in roots if r]


# ---------------------------------------------------------------------------
# progress: what /health shows while a pull runs


class Progress:
    """Bytes done of bytes known for one pull (totals grow as files start)."""

    def __init__(self, name: str):
        self.name, self.done_bytes, self.total_bytes = name, 0, 0
        self.started = time.monotonic()
        self._lock = threading.Lock()  # snapshot_download's file threads all count here

    def add(self, n: int, total: int | None = None) -> None:
        with self._lock:
            self.done_bytes += n
            if total:
                self.total_bytes = max(self.total_bytes, total)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.name, "done_bytes": self.done_bytes, "total_bytes": self.total_bytes}


_PULLS: dict[str, Progress] = {}
_PULLS_LOCK = threading.Lock()


def in_flight() -> list[dict[str, Any]]:
    """The pulls under way in this process, as ``{model, done_bytes, total_bytes}``."""
    with _PULLS_LOCK:
        return [p.as_dict() for p in _PULLS.values()]


def _bar_class(progress: Progress) -> Any:
    """huggingface_hub's progress bar (drawn on a terminal, silent elsewhere)
    that also counts bytes into ``progress``: snapshot_download's aggregate bar
    and a single file's bar. It counts itself, because a disabled tqdm (no
    terminal) does not advance ``n``."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    byte_bars = ("huggingface_hub.snapshot_download", "huggingface_hub.http_get")

    class Bar(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            self._ember_counts = kwargs.get("name") in byte_bars
            super().__init__(*args, **kwargs)
            if self._ember_counts:
                progress.add(int(kwargs.get("initial") or 0))

        def update(self, n: float | None = 1) -> bool | None:
            if self._ember_counts:
                progress.add(int(n or 0), int(self.total or 0))
            return super().update(n)

    return Bar


# ---------------------------------------------------------------------------
# finding what is here


def is_mlx_dir(path: pathlib.Path) -> bool:
    """A complete safetensors model: its config and every shard its index names
    (a folder an interrupted download left without its tree listing has the
    index and only some shards)."""
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return any(path.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False
    return bool(shards) and all((path / str(s)).is_file() for s in shards)


def _pick_gguf(files: list[str], ref: HubRef) -> str:
    """The GGUF file of a repo that ``ref`` names: the one whose name holds its
    quant tag (case-insensitive; a whole-word match wins over a substring), or
    the only one."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if not ggufs:
        raise HubError(f"{ref.repo_id} has no .gguf file{f' to match :{ref.quant}' if ref.quant else ''}")
    if ref.quant:
        tag = ref.quant.lower()
        hits = [f for f in ggufs if tag in pathlib.PurePosixPath(f).name.lower()]
        word = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])")
        exact = [f for f in hits if word.search(pathlib.PurePosixPath(f).name.lower())]
        hits = exact if len(exact) == 1 else hits
    else:
        hits = ggufs
    if len(hits) != 1:
        names = ", ".join(pathlib.PurePosixPath(f).name for f in (hits or ggufs)[:12])
        what = f"{len(hits)} files match :{ref.quant}" if ref.quant and hits else "name one with :QUANT"
        raise HubError(f"{ref.repo_id}: {what} ({names})")
    if _SPLIT_GGUF.search(hits[0]):
        raise HubError(f"{ref.repo_id}: {hits[0]} is one part of a split GGUF, which Ember does not read yet")
    return hits[0]


def _snapshot_dir(ref: HubRef) -> pathlib.Path | None:
    """The cached snapshot folder of ``ref``'s revision, if the cache has one."""
    from huggingface_hub.file_download import repo_folder_name

    storage = hub_cache() / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    rev = ref.revision or "main"
    commit = rev
    if not _GIT_SHA1.fullmatch(rev):
        try:
            commit = (storage / "refs" / rev).read_text().strip()
        except OSError:
            return None
    path = storage / "snapshots" / commit
    return path if path.is_dir() else None


def _files_under(root: pathlib.Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def _local_hf(ref: HubRef) -> pathlib.Path | None:
    """What huggingface_hub's cache holds for ``ref``: an MLX directory or a GGUF file."""
    if ref.quant is None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            path = pathlib.Path(
                snapshot_download(
                    ref.repo_id, revision=ref.revision, allow_patterns=ALLOW_PATTERNS, local_files_only=True
                )
            )
        except (LocalEntryNotFoundError, ValueError, OSError):
            path = None
        if path is not None and is_mlx_dir(path):
            return path
    snap = _snapshot_dir(ref)
    if snap is None:
        return None
    try:
        return snap / _pick_gguf(_files_under(snap), ref)
    except HubError:
        return None


def lmstudio_path(ref: HubRef) -> pathlib.Path | None:
    for root in lmstudio_roots():
        path = root / ref.repo_id
        if not path.is_dir():
            continue
        if ref.quant is None and is_mlx_dir(path):
            return path
        try:
            return path / _pick_gguf(_files_under(path), ref)
        except HubError:
            continue
    return None


def local_path(ref: HubRef) -> pathlib.Path | None:
    """``ref``'s model if it is on this machine already (an MLX directory or a
    GGUF file), with no network: the hub cache, then LM Studio's folder."""
    return _local_hf(ref) or lmstudio_path(ref)


# ---------------------------------------------------------------------------
# pulling


def _explain(ref: HubRef, exc: BaseException) -> HubError:
    """huggingface_hub's exception as the one line the CLI prints."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
    if isinstance(exc, GatedRepoError):
        return HubError(
            f"{ref.repo_id} is gated: accept its terms on {constants.ENDPOINT}/{ref.repo_id} and set HF_TOKEN ({token})"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{ref.repo_id} has no revision {ref.revision!r} on {constants.ENDPOINT}")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"no model {ref.repo_id} on {constants.ENDPOINT} (404) and no directory of that name here; "
            f"a private or gated repo needs HF_TOKEN ({token})"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubError(f"{ref.repo_id}: a file it lists is missing on {constants.ENDPOINT} (404)")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status in (401, 403):
            return HubError(
                f"{ref.repo_id}: access denied ({status}); set HF_TOKEN to a token that can read it ({token})"
            )
        return HubError(f"{ref.repo_id}: the hub answered {status} at {constants.ENDPOINT}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(f"disk full while downloading {ref.repo_id} into {hub_cache()}; free space and run again")
    # httpx's network errors (huggingface_hub 1.x: httpx, 2.x: httpx2), named rather than imported
    unreachable = any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)
    if isinstance(exc, LocalEntryNotFoundError) or unreachable or offline():
        return _not_here(ref)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return HubError(f"downloading {ref.repo_id} failed: {type(exc).__name__}: {first}")


def _not_here(ref: HubRef) -> HubError:
    return HubError(
        f"{ref.repo_id} is not downloaded (looked in {hub_cache()} and LM Studio's folder) and the hub "
        f"cannot be reached{' (HF_HUB_OFFLINE=1)' if offline() else ''}; `ember pull {ref}` with a network fetches it"
    )


def _blobs(ref: HubRef) -> pathlib.Path:
    from huggingface_hub.file_download import repo_folder_name

    return hub_cache() / repo_folder_name(repo_id=ref.repo_id, repo_type="model") / "blobs"


def _listing(path: pathlib.Path) -> set[str]:
    try:
        return {p.name for p in path.iterdir() if not p.name.endswith(".incomplete")}
    except OSError:
        return set()


def _verify_new_blobs(ref: HubRef, before: set[str]) -> None:
    """Hash every blob this pull wrote against the name the hub gave it (its
    LFS sha256 or git blob sha1; huggingface_hub checks only the size on a
    plain HTTP download). A mismatch removes the blob and the snapshot links
    to it, so the next pull fetches it again, and fails this one."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    blobs = _blobs(ref)
    for name in sorted(_listing(blobs) - before):
        path = blobs / name
        with open(path, "rb") as fh:
            if _SHA256.fullmatch(name):
                actual, algo = sha_fileobj(fh).hex(), "sha256"
            elif _GIT_SHA1.fullmatch(name):
                actual, algo = git_hash(fh.read()), "git sha1"
            else:
                continue
        if actual == name:
            continue
        files = _drop_blob(path)
        raise HubError(
            f"{ref.repo_id}: {', '.join(files) or name} does not match its {algo} ({actual[:12]}… is not "
            f"{name[:12]}…); the file was removed and nothing is served; run the pull again"
        )


def _drop_blob(blob: pathlib.Path) -> list[str]:
    snapshots = blob.parent.parent / "snapshots"
    names = []
    for link in snapshots.rglob("*") if snapshots.is_dir() else ():
        if link.is_symlink() and link.resolve() == blob.resolve():
            names.append(link.name)
            link.unlink()
    blob.unlink(missing_ok=True)
    return names


@dataclasses.dataclass
class _Pulling:
    progress: Progress

    def __enter__(self) -> Progress:
        with _PULLS_LOCK:
            _PULLS[self.progress.name] = self.progress
        return self.progress

    def __exit__(self, *exc: object) -> None:
        with _PULLS_LOCK:
            _PULLS.pop(self.progress.name, None)


def _download(ref: HubRef, bar: Any) -> pathlib.Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    if ref.quant is None:
        path = pathlib.Path(
            snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ALLOW_PATTERNS, tqdm_class=bar)
        )
        if is_mlx_dir(path):
            return path
    # a quant tag, or no safetensors: a GGUF repo
    files = HfApi().list_repo_files(ref.repo_id, revision=ref.revision)
    name = _pick_gguf(files, ref)
    return pathlib.Path(hf_hub_download(ref.repo_id, name, revision=ref.revision, tqdm_class=bar))


def fetch(ref: HubRef) -> pathlib.Path:
    """``ref``'s model, from this machine if it is here, else downloaded: an
    MLX directory or a GGUF file. HubError (one line) when neither works."""
    found = local_path(ref)
    if found is not None:
        log.info("[hub] found %s at %s", ref, found)
        return found
    if offline():
        raise _not_here(ref)
    blobs = _blobs(ref)
    before = _listing(blobs)
    progress = Progress(str(ref))
    log.info("[hub] pulling %s into %s", ref, hub_cache())
    with _Pulling(progress):
        try:
            path = _download(ref, _bar_class(progress))
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the pull is one HubError line
            raise _explain(ref, exc) from exc
        _verify_new_blobs(ref, before)
    log.info("[hub] pulled %s: %d bytes in %.1fs", ref, progress.done_bytes, time.monotonic() - progress.started)
    return path


def resolve(ref: HubRef, *, pull: bool = True) -> pathlib.Path:
    """``ref``'s mlx-lm model directory (a GGUF file converted once);
    ``pull=False``: HubError rather than download what is not here."""
    found = None if pull else local_path(ref)
    if not pull and found is None:
        raise _not_here(ref)
    path = found or fetch(ref)
    if path.is_file():
        from engine.mlx.gguf_convert import cached_conversion

        return cached_conversion(path)
    return path


def preflight(ref: HubRef) -> None:
    """Before a server binds: a model that is not here while offline is an
    error now; one that must be downloaded is pulled as the server starts."""
    if local_path(ref) is None and offline():
        raise _not_here(ref)


# ---------------------------------------------------------------------------
# removing


def cached_repos() -> Iterator[Any]:
    """huggingface_hub's cache entries of model repos (``scan_cache_dir``); none if there is no cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache())
    except CacheNotFound:
        return
    yield from (r for r in sorted(info.repos, key=lambda r: r.repo_id) if r.repo_type == "model")


def remove(repo_id: str) -> int:
    """Delete every cached revision of ``repo_id`` (huggingface_hub's
    ``delete_revisions`` strategy); the bytes freed. HubError if it is not cached."""
    from huggingface_hub import scan_cache_dir

    repo = next((r for r in cached_repos() if r.repo_id == repo_id), None)
    if repo is None:
        raise HubError(f"{repo_id} is not in the hub cache {hub_cache()}")
    strategy = scan_cache_dir(hub_cache()).delete_revisions(*(rev.commit_hash for rev in repo.revisions))
    freed = int(strategy.expected_freed_size)
    strategy.execute()
    return freed
