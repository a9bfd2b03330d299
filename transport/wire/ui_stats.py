"""The last requests, one small record each, for the dashboard (``/stats``
key ``recent_requests``): time to first token and where the prompt came from
(RAM tier, SSD tier, prefilled). Bounded: the oldest record leaves when a new
one arrives past ``RECENT_REQUESTS``. Fed by ``transport.wire.metrics.TokenTimer``
when a request's last token is out, so it counts what the HTTP client saw.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine.types import Usage

RECENT_REQUESTS = 64


class RecentRequests:
    def __init__(self, size: int = RECENT_REQUESTS):
        self._ring: deque[dict[str, Any]] = deque(maxlen=size)
        self.size = size
        self.seq = 0  # requests ever recorded: the dashboard tells new records from old by it

    def add(self, ttft_s: float | None, usage: Usage | None, model: str | None = None) -> None:
        """One finished request (``ttft_s`` None: it produced no token) of ``model``."""
        self.seq += 1
        rec: dict[str, Any] = {"seq": self.seq, "t": round(time.time(), 3), "ttft_ms": None}
        if model is not None:
            rec["model"] = model  # the dashboard's section for that model keeps only its own
        if ttft_s is not None:
            rec["ttft_ms"] = round(ttft_s * 1000, 1)
        if usage is not None:
            ssd = usage.ssd_cached_tokens
            rec |= {
                "prompt_tokens": usage.prompt_tokens,
                "ram_cached_tokens": usage.cached_tokens - ssd,
                "ssd_cached_tokens": ssd,
                "completion_tokens": usage.completion_tokens,
            }
            if usage.speculation is not None:
                rec["drafted"] = usage.speculation.drafted
                rec["accepted"] = usage.speculation.accepted
        self._ring.append(rec)

    def snapshot(self) -> dict[str, Any]:
        return {"size": self.size, "seq": self.seq, "requests": list(self._ring)}
