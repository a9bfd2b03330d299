"""What the registry holds for a model, whatever its kind: the methods both
``ember.api.Engine`` (chat and completions) and ``ember.embed.EmbeddingEngine``
implement, so the registry calls them instead of telling the two apart by
duck typing or reading a private field."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Served(Protocol):
    @property
    def status(self) -> str:
        """``ready``, ``loading``, ``draining`` or ``dead``: what /health says."""
        ...

    def in_flight(self) -> int:
        """Requests running now; a model with any is not idle for its keep-alive."""
        ...

    async def drain(self) -> bool:
        """Admit nothing new, finish what runs, flush; False if a deadline cut it short."""
        ...

    def stats(self) -> dict[str, Any]: ...
