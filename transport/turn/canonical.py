"""Volatile head lines, taken out of the rendered prompt.

Some clients put a line at the head of the prompt that changes on every
request and means nothing to the model. Claude Code's first system block is

    x-anthropic-billing-header: cc_version=2.1.332.9a2; cc_entrypoint=sdk-cli; cch=4f1c…;

(Anthropic's API reads it as billing metadata; ``cch`` changes per request).
Rendered as it stands, it sits before everything else, so every turn's prompt
differs from the last one at its first tokens and the prompt cache serves none
of it. Ember drops such a line (a whole system block that is only that line,
or the line out of a longer block) before rendering, and counts it
(``ember_envelope_fields_total{field="x-anthropic-billing-header",
action="canonicalised"}``). The same idea as vllm-mlx's
``prompt_canonicalize.py``.

What counts as volatile is a fixed list of line prefixes (``VOLATILE_PREFIXES``),
matched at the start of a system text; nothing else of the prompt is touched.
"""

from __future__ import annotations

VOLATILE_PREFIXES = ("x-anthropic-billing-header:",)


def volatile_prefix(text: str) -> str | None:
    """The volatile prefix ``text``'s first line starts with, if any."""
    head = text.lstrip()
    for prefix in VOLATILE_PREFIXES:
        if head[: len(prefix)].lower() == prefix:
            return prefix
    return None


def strip_volatile(text: str) -> tuple[str, str | None]:
    """``text`` without a volatile first line, and which prefix it had (None:
    unchanged). A text that is only that line becomes ``""``."""
    prefix = volatile_prefix(text)
    if prefix is None:
        return text, None
    head = text.lstrip()
    _, sep, rest = head.partition("\n")
    return (rest.lstrip("\n") if sep else ""), prefix
