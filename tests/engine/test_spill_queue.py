"""SpillQueue: serial order, drop-oldest over the cap, soft cap, release exactly once."""

from __future__ import annotations

import random

import pytest

from engine.kv.spill_queue import ItemState, SpillItem, SpillQueue
from engine.transitions import IllegalTransition


class Clones:
    """A stand-in for owned cache clones that counts its releases."""

    def __init__(self, name: str):
        self.name = name
        self.releases = 0


def item(name: str, nbytes: int, ns: str = "") -> SpillItem:
    def release(cache: Clones) -> None:
        cache.releases += 1

    return SpillItem(ns, [ord(c) for c in name], Clones(name), nbytes, release=release)


def test_writes_serially_in_enqueue_order_and_releases_each_once():
    q = SpillQueue(cap_bytes=1000)
    items = [item(n, 10) for n in "abc"]
    clones = [i.cache for i in items]
    for it in items:
        assert q.push(it) == []
    order = []
    while (nxt := q.pop_next()) is not None:
        assert q.pop_next() is None  # one writer: nothing else while one is in flight
        order.append(nxt.tokens)
        q.finish(nxt, ok=True)
    assert order == [it.tokens for it in items]
    assert [c.releases for c in clones] == [1, 1, 1]
    assert q.stats() == {
        "pending_spills": 0,
        "pending_spill_bytes": 0,
        "dropped_spills": 0,
        "failed_spills": 0,
        "stored_spills": 3,
    }


def test_over_cap_drops_the_oldest_queued_not_in_flight_not_newest_and_releases_it_at_once():
    q = SpillQueue(cap_bytes=25)
    a, b, c = item("a", 10), item("b", 10), item("c", 10)
    cb = b.cache
    q.push(a)
    assert q.pop_next() is a  # a is being written
    q.push(b)
    dropped = q.push(c)  # 30 > 25: b is the oldest that is neither in flight nor new
    assert dropped == [b]
    assert cb.releases == 1  # at drop time, not when the writer gets round to it
    assert b.state is ItemState.DROPPED and b.released and b.cache is None
    assert q.dropped == 1
    assert q.pending_bytes == 20 and q.pending == 2
    q.finish(a, ok=True)
    assert q.pop_next() is c
    q.finish(c, ok=True)
    assert [a.state, b.state, c.state] == [ItemState.STORED, ItemState.DROPPED, ItemState.STORED]


def test_drop_releases_the_clones_once_and_never_again():
    q = SpillQueue(cap_bytes=15)
    a, b = item("a", 10), item("b", 10)
    ca, cb = a.cache, b.cache
    q.push(a)
    assert q.push(b) == [a]  # a is not in flight: it goes
    assert ca.releases == 1
    q.finish(q.pop_next(), ok=True)
    q.close()
    assert (ca.releases, cb.releases) == (1, 1)


def test_a_single_oversized_item_exceeds_the_cap_rather_than_never_spilling():
    q = SpillQueue(cap_bytes=5)
    big = item("big", 100)
    assert q.push(big) == []
    assert q.pending_bytes == 100
    assert q.pop_next() is big
    # while it is written, a newer item still queues: cap + one item at most
    small = item("s", 3)
    assert q.push(small) == []
    q.finish(big, ok=True)
    assert q.pop_next() is small


def test_a_zero_cap_keeps_only_the_newest_and_the_one_in_flight():
    q = SpillQueue(cap_bytes=0)
    items = [item(n, 1) for n in "abcd"]
    q.push(items[0])
    q.pop_next()
    for it in items[1:]:
        q.push(it)
    assert [i.state for i in items] == [ItemState.IN_FLIGHT, ItemState.DROPPED, ItemState.DROPPED, ItemState.QUEUED]
    assert q.dropped == 2


def test_a_failed_store_releases_the_clones_and_the_queue_keeps_writing():
    q = SpillQueue(cap_bytes=100)
    a, b = item("a", 10), item("b", 10)
    ca = a.cache
    q.push(a)
    q.push(b)
    q.finish(q.pop_next(), ok=False)
    assert ca.releases == 1 and q.failed == 1
    assert q.pop_next() is b
    q.finish(b, ok=True)
    assert q.stats()["failed_spills"] == 1 and q.stats()["stored_spills"] == 1


def test_close_discards_what_is_queued_and_in_flight_and_later_pushes():
    q = SpillQueue(cap_bytes=100)
    a, b = item("a", 10), item("b", 10)
    q.push(a)
    q.push(b)
    q.pop_next()
    left = q.close()
    assert left == [a, b] and a.released and b.released
    late = item("c", 1)
    assert q.push(late) == [late] and late.state is ItemState.DISCARDED and late.released
    with pytest.raises(IllegalTransition):
        q.finish(a, ok=True)  # the writer reporting back after close is refused, not double-freed


def test_illegal_moves_and_double_release_raise():
    it = item("a", 1)
    with pytest.raises(IllegalTransition):
        it.move(ItemState.STORED)  # queued -> stored skips the write
    it.free()
    with pytest.raises(IllegalTransition):
        it.free()


def test_random_operations_keep_the_cap_plus_one_and_release_everything_exactly_once():
    """Property 6 over seeded random pushes/finishes: bytes never exceed cap plus
    one item, and every item is released exactly once by the end."""
    for seed in range(20):
        rng = random.Random(seed)
        cap = rng.randint(0, 60)
        q = SpillQueue(cap_bytes=cap)
        made: list[SpillItem] = []
        clones: list[Clones] = []
        for step in range(200):
            if rng.random() < 0.6:
                it = item(f"{seed}-{step}", rng.randint(1, 40))
                made.append(it)
                clones.append(it.cache)
                q.push(it)
                biggest = max(i.nbytes for i in q.items)
                in_flight = q.in_flight.nbytes if q.in_flight is not None else 0
                assert q.pending_bytes <= max(cap, 0) + biggest + in_flight
                assert q.pending_bytes == sum(i.nbytes for i in q.items)
            else:
                nxt = q.in_flight or q.pop_next()
                if nxt is not None:
                    q.finish(nxt, ok=rng.random() < 0.8)
        q.close()
        assert [c.releases for c in clones] == [1] * len(made)
        counts = [i.state for i in made]
        assert counts.count(ItemState.STORED) == q.stored
        assert counts.count(ItemState.FAILED) == q.failed
        assert counts.count(ItemState.DROPPED) == q.dropped
