"""Streaming text with stop strings that may span token boundaries.

mlx-lm's ``StopSequences`` matches token-id sequences; users give *strings*,
and a stop string can start in one token and end in the next (or inside a
token). So we match on the detokenized text and hold back the longest tail
that could still become a stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._hold = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what is now safe to emit (``stopped`` says if a stop hit)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._hold + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._hold = ""
            return buf[:cut]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self._hold = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of stream: the held-back tail was not a stop after all."""
        out, self._hold = self._hold, ""
        return "" if self.stopped else out
