"""A request's cache namespace: the one string every cache tier keys by.

The RAM prefix cache (``engine.kv.prompt_cache``), the SSD tier's folders, file
names and headers (``engine.kv.cold_store``: ``ns_folder``, ``entry_id``,
``KvMeta.ns``), the durability records and the speculation policy's learned
seeds (``engine.speculation.policy.Learned``) all key by ``(ns, tokens)``, so a
prefix cached under one namespace is a miss under every other: a tenant cannot
time another's prompts (a hit answers its first token sooner), and an adapter's
KV is never served to the base model.

The empty namespace is the server without keys and without adapters: its keys
are the ones written before namespaces had parts, byte for byte, so an SSD
cache written then is still found (tests/engine/test_namespace.py).

A namespace is made of parts, each ``kind:value`` and joined by ``/`` in a
fixed order: the key scope (``--api-keys``: the key's name, docs/http.md) and,
the LoRA adapter (its name and content hash, ``engine.adapters``; issue #43). A part's value
may not hold ``/`` or ``:`` (key names are checked where they are read), so two
different sets of parts never spell the same namespace.
"""

from __future__ import annotations

import re

__all__ = ["cache_namespace", "namespace_adapter", "PART_VALUE"]

# What a part's value may hold: no separator, no control character, bounded.
PART_VALUE = re.compile(r"[A-Za-z0-9_.@+=-]{1,128}")


def cache_namespace(*, key_scope: str = "", adapter: str = "") -> str:
    """The namespace of a request made under API key ``key_scope`` (a key's
    name; empty: no keys file, or a single ``--api-key``) with adapter
    ``adapter`` (empty: the base model). Both empty: ``""``, today's keys."""
    parts = []
    for kind, value in (("key", key_scope), ("adapter", adapter)):
        if not value:
            continue
        if not PART_VALUE.fullmatch(value):
            raise ValueError(f"a cache namespace's {kind} must match {PART_VALUE.pattern}, got {value!r}")
        parts.append(f"{kind}:{value}")
    return "/".join(parts)


def namespace_adapter(ns: str) -> str:
    """The adapter part of a namespace (``NAME@HASH``), or ``""`` for the base
    model: how the backend learns a row's adapter from the row's namespace."""
    for part in ns.split("/"):
        kind, _, value = part.partition(":")
        if kind == "adapter":
            return value
    return ""
