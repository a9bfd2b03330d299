"""How a model's template writes tool calls (``ToolMarkup``) and marks its
reasoning (``ReasoningMarkup``): neutral types that the MLX tokenizer, the fake
one and the transport's parsers share, so none of them reaches into another
wing of ``engine/`` for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolMarkup:
    """How a model's template writes tool calls: mlx-lm's markers and parser."""

    start: str
    end: str
    parser: Callable[[str, Any], Any]
    json_form: bool  # mlx-lm's `json_tools` form, for which a forced call's grammar is written


@dataclass(frozen=True)
class ReasoningMarkup:
    """How a model marks its reasoning: mlx-lm's ``think_start`` / ``think_end``."""

    start: str
    end: str
