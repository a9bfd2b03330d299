"""Cache namespaces (engine/kv/namespace.py, issue #44): the empty one keys
every tier exactly as before namespaces had parts, so an SSD cache written
then is still found; the speculation policy's learned seeds are kept per
namespace."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from engine.kv.cold_store import entry_id, ns_folder
from engine.kv.namespace import cache_namespace
from engine.speculation.policy import GammaPolicy


# The SSD tier's naming as it was at 3fe3849 (before key scopes), copied
# verbatim: what files already on disk are named by.
def old_ns_folder(ns: str) -> str:
    return "base" if ns == "" else hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()


def old_entry_id(tokens: np.ndarray, ns: str) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(ns.encode() + b"\0")
    h.update(tokens.astype("<i8").tobytes())
    return h.hexdigest()


def test_the_empty_namespace_names_files_as_before():
    ns = cache_namespace()
    assert ns == "" and cache_namespace(key_scope="", adapter="") == ""
    rng = np.random.default_rng(0)
    for n in (1, 17, 300):
        tokens = rng.integers(0, 50_000, n)
        assert entry_id(tokens, ns) == old_entry_id(tokens, "")
        assert ns_folder(ns) == old_ns_folder("") == "base"
    # A key scope is another file and another folder.
    tokens = np.arange(20)
    alice, bob = cache_namespace(key_scope="alice"), cache_namespace(key_scope="bob")
    assert len({entry_id(tokens, ns) for ns in ("", alice, bob)}) == 3
    assert len({ns_folder(ns) for ns in ("", alice, bob)}) == 3


def test_parts_compose_and_never_collide():
    assert cache_namespace(key_scope="alice") == "key:alice"
    assert cache_namespace(adapter="sql@ab12") == "adapter:sql@ab12"
    assert cache_namespace(key_scope="alice", adapter="sql@ab12") == "key:alice/adapter:sql@ab12"
    for bad in ("a/b", "a:b", "", "x" * 129, "sp ace", "nul\0"):
        if bad:
            with pytest.raises(ValueError):
                cache_namespace(key_scope=bad)
    # a key name cannot spell another key's namespace with an adapter part
    with pytest.raises(ValueError):
        cache_namespace(key_scope="alice/adapter:sql@ab12")


def test_speculation_seeds_are_learned_per_namespace():
    """A row's rounds teach its own namespace's seeds: bob's new row starts
    from the priors whatever alice's text did."""
    p = GammaPolicy()
    fresh = p.new_row(None, "key:bob")
    alice = p.new_row(None, "key:alice")
    for _ in range(20):  # alice's text copies: every draft accepted, six deep
        p.observe_round(alice, 6, 6)
    assert p.learned("key:alice").accept[0] > fresh.accept[0] + 0.1
    assert p.learned("key:alice").depth_seed == 6
    bob = p.new_row(None, "key:bob")
    assert bob.accept == fresh.accept and bob.depth_seed == fresh.depth_seed == 0
    assert p.new_row(None).accept == fresh.accept  # nor the empty namespace's
    assert p.new_row(None, "key:alice").depth_seed == 6  # alice's next request does learn from it


def test_the_verifier_teaches_the_windows_namespace():
    """The Scheduler's windows carry the row's namespace to the Verifier
    (actors.spec_rounds -> Window.ns): what a row's rounds teach lands there."""
    from actors.verifier import VerifierCore, Verify, Window

    core = VerifierCore(GammaPolicy())
    before = list(core.policy.learned("").accept)
    for _ in range(10):
        core.verify(Verify(windows=[Window(rid=1, drafts=[7] * 4, targets=[7] * 4 + [8], ns="key:alice")]))
    assert core.policy.learned("key:alice").accept[0] > before[0]
    assert core.policy.learned("").accept == before
