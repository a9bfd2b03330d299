"""Who is asking: the server's API keys, each with a name.

``--api-key KEY`` is one secret every client shares (``SingleKey``): every
request runs in the empty cache namespace, as it always did. ``--api-keys
FILE`` is a JSON object of named keys (``KeysFile``)::

    {"admin": "…", "alice": "…", "bob": "…"}

Each key's name is its cache scope (``engine.kv.namespace``): a prefix alice's
requests cached is a miss for bob's, so bob cannot tell from his time to first
token whether alice sent it. The key named ``admin`` (``ADMIN``) is the only
one the operator routes accept (``/admin/*``, ``/stats``, ``/metrics``: they
show every tenant's traffic); without one those routes answer 403 to everyone.

The file is read again when its modification time or size changes (checked on
each request, one ``stat``): keys can be added and revoked without a restart.
A file that does not parse is a startup error; a bad edit later is logged and
the last good keys stay in force, so a typo cannot lock every client out.
Secrets are compared in constant time, against every key (no early exit).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from engine.kv.namespace import PART_VALUE

log = logging.getLogger("ember.keys")

ADMIN = "admin"  # the name of the key the operator routes accept
MAX_FILE_BYTES = 1 << 20
# The ASGI scope entry that carries the authenticated key's name from
# transport.server.security to the routes.
SCOPE_KEY = "ember.key_name"


def key_name(scope: Any) -> str:
    """The name of the key a request was authenticated with (``""``: no key
    configured, or the single ``--api-key``). ``scope``: an ASGI scope or a
    Starlette request."""
    value = scope.get(SCOPE_KEY, "")
    return value if isinstance(value, str) else ""


class KeysFileError(ValueError):
    """The keys file cannot be used (unreadable, not JSON, a bad name or key)."""


class Keys(Protocol):
    """What ``transport.server.security`` asks of the configured keys."""

    def name_of(self, secret: bytes) -> str | None:
        """The name of the key ``secret`` is (``""``: the single unnamed key), or None."""
        ...

    def is_admin(self, name: str) -> bool:
        """May the key named ``name`` use the operator routes?"""
        ...


class SingleKey:
    """``--api-key``: one unnamed key, which may do everything (as before keys had names)."""

    def __init__(self, secret: str):
        self.secret = secret.encode()

    def name_of(self, secret: bytes) -> str | None:
        return "" if hmac.compare_digest(secret, self.secret) else None

    def is_admin(self, name: str) -> bool:
        return True


def parse_keys(data: bytes, source: str = "the keys file") -> dict[str, bytes]:
    """``{name: secret}`` from a keys file's bytes; ``KeysFileError`` says what is wrong."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise KeysFileError(f"{source} is not JSON: {exc}") from None
    if not isinstance(obj, dict) or not obj:
        raise KeysFileError(f'{source} must be a non-empty JSON object of named keys, e.g. {{"alice": "KEY"}}')
    keys: dict[str, bytes] = {}
    owner: dict[bytes, str] = {}
    for name, secret in obj.items():
        if not PART_VALUE.fullmatch(name):
            raise KeysFileError(f"{source}: the key name {name!r} must match {PART_VALUE.pattern}")
        if not isinstance(secret, str) or not secret or secret != secret.strip() or not secret.isprintable():
            raise KeysFileError(
                f"{source}: the key of {name!r} must be a non-empty string without spaces around it "
                "or control characters"
            )
        raw = secret.encode()
        if raw in owner:  # a shared secret would make the two names one tenant, silently
            raise KeysFileError(f"{source}: {owner[raw]!r} and {name!r} have the same key")
        owner[raw] = name
        keys[name] = raw
    return keys


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise KeysFileError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return data


class KeysFile:
    """``--api-keys FILE``: named keys, read again when the file changes.

    ``stat`` and ``read`` are the file system (a test hands in its own)."""

    def __init__(
        self,
        path: str,
        *,
        stat: Callable[[str], os.stat_result] = os.stat,
        read: Callable[[str], bytes] = _read,
    ):
        self.path = path
        self._stat, self._read = stat, read
        self.reloads = 0  # good reads after the first
        self.reload_errors = 0  # bad edits, each logged once (the last good keys stay)
        try:
            self._seen = self._version()
            self.keys = parse_keys(self._read(path), path)
        except OSError as exc:
            raise KeysFileError(f"cannot read the keys file {path}: {exc.strerror or exc}") from None
        if ADMIN not in self.keys:
            log.warning("[keys] no key named %r in %s: /admin/*, /stats and /metrics answer 403", ADMIN, path)
        log.info("[keys] loaded names=%s", sorted(self.keys))

    def _version(self) -> tuple[int, int, int]:
        st = self._stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def refresh(self) -> None:
        """Read the file again if it changed since it was last read (good or bad)."""
        try:
            version = self._version()
        except OSError as exc:
            version = (-1, -1, -1)  # gone: report it once, keep the keys
            if version != self._seen:
                self._seen = version
                self.reload_errors += 1
                log.error("[keys] reload failed path=%s error=%r: keeping the last good keys", self.path, exc)
            return
        if version == self._seen:
            return
        self._seen = version
        try:
            keys = parse_keys(self._read(self.path), self.path)
        except (OSError, KeysFileError) as exc:
            self.reload_errors += 1
            log.error("[keys] reload failed path=%s error=%s: keeping the last good keys", self.path, exc)
            return
        added, removed = sorted(keys.keys() - self.keys.keys()), sorted(self.keys.keys() - keys.keys())
        self.keys = keys
        self.reloads += 1
        log.info("[keys] reloaded names=%d added=%s removed=%s", len(keys), added, removed)

    def name_of(self, secret: bytes) -> str | None:
        self.refresh()
        found = None
        for name, key in self.keys.items():  # every key compared: the time says nothing of which matched
            if hmac.compare_digest(secret, key):
                found = name
        return found

    def is_admin(self, name: str) -> bool:
        return name == ADMIN
