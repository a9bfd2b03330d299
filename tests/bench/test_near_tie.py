"""bench.near_tie rebuilds the turn's prompt from the reference's own history
and cuts the replies' common prefix where the next token starts."""

from __future__ import annotations

from bench import near_tie
from bench.agent_session import SYSTEM, user_turns


def test_the_prompt_is_the_references_history_up_to_the_turn():
    rows = [
        {"server": s, "turn": k, "reply": f"{s} reply {k}"}
        for k in (1, 2, 3)
        for s in ("ember", "mlx_lm.server", "rapid-mlx")
    ]
    rows[-3]["reply"] = "The line is quoted from the first line."
    rows[-2]["reply"] = "The line is quoted from the output."
    history, mine, ref = near_tie.turn_prompt(rows, 3, 6)
    texts = user_turns(6)
    assert history[0] == {"role": "system", "content": SYSTEM}
    assert [m["content"] for m in history[1:]] == [
        texts[0], "mlx_lm.server reply 1", texts[1], "mlx_lm.server reply 2", texts[2]
    ]  # fmt: skip
    assert near_tie.common_prefix(mine, ref) == "The line is quoted from the"
    assert near_tie.common_prefix("same", "same") == "same"
