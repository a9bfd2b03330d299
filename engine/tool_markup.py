"""How a model's template writes tool calls (``ToolMarkup``): a neutral type
that the MLX tokenizer, the fake one and the transport's tool-call parsers
share, so none of them reaches into another wing of ``engine/`` for it."""

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
