"""A follower's side of the distributed SSD tier (actors/distributed_tier.py),
in one process: the real files, caches and store, with the group's agreement
played by a stub link (the two-rank engine itself: tests/sims/test_distributed_ssd.py).

What must hold whatever the other ranks answer: a write stays on disk only when
every rank's write succeeded; a restore is kept only when every rank read a
valid copy; otherwise this rank's file of the entry is deleted."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from actors.distributed_tier import FollowerTier, PersistOp, RestoreOp, encode_op, rank_root, rank_store
from engine.ports import ModelInfo

INFO = ModelInfo("m", 100, 4096, "fp", "tok", 2)
TOKENS = list(range(1, 41))


class StubLink:
    """What the other ranks say: ``others_ok`` is ANDed with this rank's part."""

    def __init__(self, others_ok: bool = True):
        self.others_ok = others_ok
        self.said: list[bool] = []

    def agree(self, ok: bool) -> bool:
        self.said.append(ok)
        return ok and self.others_ok


def kv_cache(n: int = len(TOKENS)) -> list[KVCache]:
    out = []
    for seed in (1, 2):
        c = KVCache()
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        c.update_and_fetch(k, k * 2)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


@pytest.fixture
def store(tmp_path):
    return rank_store(str(tmp_path), INFO, rank=1, size=2, max_bytes=1 << 30, verify=True)


def persist(tier: FollowerTier, stored: dict, name: int = 7) -> None:
    tier.handle(encode_op(PersistOp(name, TOKENS, "", 0.0)), stored)


def test_each_rank_has_its_own_folder(tmp_path):
    assert rank_root(str(tmp_path), 1, 2) == str(tmp_path / "rank1of2")
    assert rank_root(str(tmp_path), 1, 4) != rank_root(str(tmp_path), 1, 2)  # another split, other shards


def test_a_write_stays_only_when_every_rank_wrote(store):
    stored = {7: kv_cache()}
    link = StubLink(others_ok=True)
    persist(FollowerTier(store, link), stored)
    assert link.said == [True] and len(store) == 1
    path = store.path_for(np.array(TOKENS), "")
    assert store.disk.stat(path).is_file

    # another rank fails the same entry's rewrite: this rank's file goes too (an
    # entry on some ranks only could never be restored)
    persist(FollowerTier(store, StubLink(others_ok=False)), stored)
    assert len(store) == 0
    with pytest.raises(FileNotFoundError):
        store.disk.stat(path)


def test_a_write_of_an_entry_this_rank_does_not_hold_fails_the_group(store):
    link = StubLink()
    persist(FollowerTier(store, link), {})  # name 7 unknown here
    assert link.said == [False] and len(store) == 0


def test_a_restore_is_kept_only_when_every_rank_read_its_copy(store):
    cache = kv_cache()
    persist(FollowerTier(store, StubLink()), {7: cache})
    stored: dict = {}
    link = StubLink()
    tier = FollowerTier(store, link)  # a restart: the store scans its folder again
    tier.handle(encode_op(RestoreOp(-1, TOKENS, "", 30)), stored)
    assert link.said == [True]
    got = stored[-1]
    assert [c.offset for c in got] == [30, 30]  # trimmed to the prefix rank 0 asked for
    for a, b in zip(got, cache):
        assert mx.array_equal(a.state[0][..., :30, :], b.state[0][..., :30, :]).item()
        assert mx.array_equal(a.state[1][..., :30, :], b.state[1][..., :30, :]).item()

    # another rank's copy was bad: a miss here too, and this rank's file is deleted
    link = StubLink(others_ok=False)
    tier.link = link
    tier.handle(encode_op(RestoreOp(-2, TOKENS, "", 30)), stored)
    assert link.said == [True] and -2 not in stored
    assert len(store) == 0


def test_a_corrupt_or_missing_shard_says_no(store):
    persist(FollowerTier(store, StubLink()), {7: kv_cache()})
    path = store.path_for(np.array(TOKENS), "")
    with open(path, "r+b") as f:  # a flipped byte in the last tensor
        f.seek(-10, 2)
        b = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    link, stored = StubLink(), {}
    FollowerTier(store, link).handle(encode_op(RestoreOp(-1, TOKENS, "", 30)), stored)
    assert link.said == [False] and not stored
    with pytest.raises(FileNotFoundError):
        store.disk.stat(path)
    link = StubLink()  # now missing altogether
    FollowerTier(store, link).handle(encode_op(RestoreOp(-2, TOKENS, "", 30)), stored)
    assert link.said == [False] and not stored


def test_without_a_store_every_op_fails_so_none_happens_anywhere():
    link, stored = StubLink(), {7: kv_cache()}
    tier = FollowerTier(None, link)
    persist(tier, stored)
    tier.handle(encode_op(RestoreOp(-1, TOKENS, "", 30)), stored)
    assert link.said == [False, False] and -1 not in stored
