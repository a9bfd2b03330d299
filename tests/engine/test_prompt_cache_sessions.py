"""Session-aware eviction in the RAM tier (engine.kv.prompt_cache, ``session``):
a live session's recent entries are evicted after every other entry, so an
agent's prefix survives the traffic that runs while the agent runs a tool.

Each test runs the same traffic with and without the key: the key must be what
turns the miss into a hit, or the test proves nothing.
"""

from __future__ import annotations

import pytest

from engine.fake.gpu import FakeBackend
from engine.kv.prompt_cache import PromptCache

BE = FakeBackend()


def feed(tokens: list[int]):
    cache = BE.make_cache()
    BE._feed(cache, tokens)
    return cache


def tier(cap_tokens: int, clock: list[float], **kw) -> PromptCache:
    return PromptCache(BE, cap_tokens * BE.cache_nbytes(feed([1])), now=lambda: clock[0], **kw)


SESSION = list(range(100, 140))  # an agent's turn 1 (prompt + answer), 40 tokens
TURN2 = SESSION + [7, 8, 9]  # turn 2 extends it


def others(n: int) -> list[list[int]]:
    """One-off prompts of 30 tokens, none sharing a token with the session."""
    return [list(range(1000 + 100 * i, 1030 + 100 * i)) for i in range(n)]


def run(key: str | None, *, pressure: int = 4, gap_s: float = 30.0, cap: int = 100) -> tuple[int, PromptCache]:
    clock = [0.0]
    pc = tier(cap, clock)
    pc.put(SESSION, "", feed(SESSION), session=key)
    for other in others(pressure):  # the traffic while the agent runs its tool
        clock[0] += gap_s / pressure
        pc.put(other, "", feed(other))
    return pc.take(TURN2, "", session=key)[1], pc


def test_a_live_sessions_prefix_survives_other_traffic():
    hit, pc = run("codex-conversation-1")
    assert hit == len(SESSION)
    assert pc.stats()["session_kept"] >= 1 and pc.stats()["sessions"] == 1
    miss, plain = run(None)  # the same traffic without the key: plain LRU evicts the session
    assert miss == 0 and plain.stats()["session_kept"] == 0


def test_an_idle_session_is_evicted_like_any_entry():
    hit, _ = run("k", gap_s=400.0)  # past the 300 s session lifetime: no longer protected
    assert hit == 0


def test_only_live_sessions_left_is_plain_lru():
    """When every entry belongs to a live session, the oldest goes: the cap holds."""
    clock = [0.0]
    pc = tier(70, clock)
    a, b = list(range(100, 140)), list(range(500, 540))
    pc.put(a, "", feed(a), session="a")
    clock[0] += 1
    pc.put(b, "", feed(b), session="b")
    assert pc.bytes <= pc.max_bytes and len(pc) == 1
    assert pc.peek(b + [1], "") == len(b) and pc.peek(a + [1], "") == 0


def test_unkeyed_fresh_entry_yields_to_a_live_session():
    """A fresh entry without a key is itself the one evicted when everything else is kept for a session."""
    clock = [0.0]
    pc = tier(60, clock)
    pc.put(SESSION, "", feed(SESSION), session="k")
    other = others(1)[0]
    pc.put(other, "", feed(other))
    assert pc.peek(TURN2, "") == len(SESSION) and pc.peek(other + [1], "") == 0


def test_a_session_keeps_only_its_recent_entries():
    """A session holds at most ``session_keep`` entries above the rest: older ones age out normally."""
    clock = [0.0]
    pc = tier(200, clock, session_keep=2)
    mine = [list(range(100 * i + 5000, 100 * i + 5030)) for i in range(4)]  # four unrelated prompts, one key
    for p in mine:
        clock[0] += 1
        pc.put(p, "", feed(p), session="k")
    for other in others(4):
        clock[0] += 1
        pc.put(other, "", feed(other))
    held = [pc.peek(p + [1], "") > 0 for p in mine]
    assert held == [False, False, True, True]


def test_take_makes_the_entry_the_sessions_own():
    """A session that hits an entry (a shared system prompt) keeps it alive."""
    clock = [0.0]
    pc = tier(100, clock)
    pc.put(SESSION, "", feed(SESSION))  # put without a key (another client's)
    assert pc.take(TURN2, "", session="k")[1] == len(SESSION)
    for other in others(4):
        clock[0] += 5
        pc.put(other, "", feed(other))
    assert pc.peek(TURN2, "") == len(SESSION)


def test_sessions_are_forgotten_with_their_entries():
    clock = [0.0]
    pc = tier(100, clock)
    pc.put(SESSION, "", feed(SESSION), session="k")
    pc.put(TURN2, "", feed(TURN2), session="k")  # supersedes turn 1
    assert pc.stats()["sessions"] == 1 and len(pc) == 1
    clock[0] += 1000
    for other in others(4):
        pc.put(other, "", feed(other))
    assert pc.stats()["sessions"] == 0  # the entry went, and the session with it
    pc.clear()
    assert len(pc.sessions) == 0


@pytest.mark.parametrize("key", [None, "k"])
def test_the_key_never_changes_what_a_lookup_serves(key):
    """Entries are shared: another session (or none) hits a keyed entry all the same."""
    clock = [0.0]
    pc = tier(100, clock)
    pc.put(SESSION, "", feed(SESSION), session="k")
    assert pc.take(TURN2, "", session=key)[1] == len(SESSION)


def test_one_tenants_session_key_does_not_touch_anothers():
    """Under named API keys (issue #44) the same ``prompt_cache_key`` in two
    namespaces is two sessions: bob's entries under alice's key name cannot
    push alice's out of her session's keep."""

    def alice_kept(bob_ns: str) -> bool:
        clock = [0.0]
        pc = tier(200, clock, session_keep=2)
        mine = list(range(5000, 5030))
        pc.put(mine, "key:alice", feed(mine), session="k")
        for i in range(2):  # bob's two entries under the same session name
            clock[0] += 1
            p = list(range(7000 + 100 * i, 7030 + 100 * i))
            pc.put(p, bob_ns, feed(p), session="k")
        for other in others(4):
            clock[0] += 1
            pc.put(other, "", feed(other))
        return pc.peek(mine + [1], "key:alice") > 0

    assert alice_kept("key:bob")
    assert not alice_kept("key:alice")  # the same namespace: one session, bob's two entries took the keep
