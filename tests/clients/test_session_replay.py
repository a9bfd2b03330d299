"""The captured Claude Code session replayed, body by body and unchanged,
against Ember (the scripted model: a large context, instant prefill): from
turn 2 on, ``cache_read_input_tokens`` covers at least the previous turn's
whole prompt, on every turn, including the first turn after a restart with the
SSD tier (issue #29, "every turn a cache hit")."""

from __future__ import annotations

import httpx
import pytest

from tests.clients.session import FIXTURES, load_session, prompt_tokens, replay_turn
from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

RESTART_AFTER = 6  # turns served before the restart; the rest by a fresh server on the same SSD tier


def test_every_turn_after_the_first_reads_the_previous_prompt_from_cache(tmp_path):
    session = load_session()
    turns = session["turns"]
    assert len(turns) >= 10
    script = FIXTURES / "claude_code_session.script.json"
    flags = ("--model", f"scripted:{script}", "--ssd-cache", str(tmp_path / "ssd"))
    usages: list[dict[str, int]] = []
    with httpx.Client() as client:
        for part in (turns[:RESTART_AFTER], turns[RESTART_AFTER:]):
            with ember_serve(*flags) as (_, url):  # leaving it stops the server (SIGTERM: the SSD flush is durable)
                usages += [replay_turn(client, url, t) for t in part]
    misses = [
        f"turn {i + 1}: cache_read_input_tokens {u.get('cache_read_input_tokens', 0)} < previous prompt {prompt_tokens(prev)}"
        for i, (prev, u) in enumerate(zip(usages, usages[1:]), start=1)
        if u.get("cache_read_input_tokens", 0) < prompt_tokens(prev)
    ]
    assert not misses, "\n".join(misses)
