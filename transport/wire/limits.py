"""The output limit every HTTP route gives the engine (chat completions,
completions, Anthropic Messages, OpenAI Responses).

A request's ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``
is how many tokens the client allows, not how many it needs: one above what the
context leaves after the prompt is clamped to that room, and the answer ends
with the ordinary length reason (``length``, ``max_tokens``, ``incomplete``)
if it gets there. A missing limit means "what the context leaves" — or the
operator's cap (``build_app(default_max_tokens=N)``, ``ember serve
--default-max-tokens N``) where one is set. A prompt that leaves no room at
all is still a 400: the limit given back then is what the request asked for
(or 1), and ``engine.limits.check_limits`` refuses it naming the prompt.
"""

from __future__ import annotations


def output_limit(requested: int | None, prompt_tokens: int, context_length: int, cap: int | None = None) -> int:
    """The ``max_tokens`` to run with. A requested value below 1 is passed on
    unchanged for the engine's own 400 on it."""
    room = context_length - prompt_tokens
    if room < 1:
        return 1 if requested is None else requested  # check_limits: the prompt fills the context
    if requested is None:
        return room if cap is None else max(1, min(cap, room))
    return min(requested, room) if requested >= 1 else requested
