"""How many prompt tokens a step may prefill while other rows decode.

A step runs its prefill chunk and the decode rows' forward back to back
(``SchedulerCore.plan``), so a chunk's time is added to every running stream's
inter-token latency. At the full ``prefill_chunk`` (512) a 7k-token prompt
arriving beside two streams put their p99 ITL at 14-95x its value alone on
SmolLM2 (docs/bench/itl-prefill.md): one 512-token chunk late in a long prompt
cost 25-180 decode steps, attention over the offset growing with it. So while
rows decode, the chunk is sized from what steps were measured to cost: at
most ``share`` of a decode step's time (share 0.5: a step with prefill takes
~1.5 decode steps, the 2x bound with room for noise), at least ``floor``
tokens so the prompt always advances; with nothing decoding, or before any
decode-only step was measured, the chunk is the full ``prefill_chunk``. The cost per prompt token is a moving average over
the latest steps, so it follows the growth with the offset. The trade: a long
prompt's own time to first token grows while others stream (it gets about a
third of the device instead of all of it), as in vLLM's decode-first
chunked prefill; ``share=None`` restores the full chunk.

A short prompt is not chunked that way (``whole``): a row whose whole
remaining prompt costs at most ``burst`` decode steps prefills in one step,
beside the share, up to ``burst`` decode steps of such rows a step. Eight
48-token requests sent together to SmolLM2 had been admitted one every ~0.55 s
(16 tokens a step, the floor, each row's prompt in three steps behind the
previous one's): the eighth's first token came after 3.7 s and the batch ran
at 0.71x mlx_lm.server's aggregate, which prefills them together (issue #45,
the share's commit a45cce0). Holding a short prompt saves the running streams
little (its prefill is a few steps' time whenever it runs) and costs the batch
its row; a long prompt, the share's case, still advances by the share.
"""

from __future__ import annotations


class PrefillBudget:
    def __init__(
        self, chunk: int, share: float | None = 0.5, *, floor: int = 16, alpha: float = 0.3, burst: float = 16.0
    ):
        self.chunk = chunk
        self.share = share
        self.burst = burst  # decode steps' time a step may spend on short prompts whole (``whole``)
        self.floor = min(floor, chunk)
        self.alpha = alpha
        self.decode_s: float | None = None  # a step that only decoded
        self.token_s: float | None = None  # a prompt token's share of a step with prefill

    def budget(self, decoding: bool) -> int:
        """Prompt tokens for the next step (``decoding``: some row decodes in it)."""
        if not decoding or self.share is None or self.decode_s is None:
            # No decode-only step measured yet: the rows decoding now started in
            # the steps that are prefilling (requests arriving together), and a
            # small chunk would starve the rest of the prompts without ever
            # measuring one (every step keeps prefilling). The full chunk, as before.
            return self.chunk
        if self.token_s is None or self.token_s <= 0:
            return self.floor  # decode priced, prefill not: measure before spending the streams' time
        return max(self.floor, min(self.chunk, int(self.share * self.decode_s / self.token_s)))

    def whole(self, decoding: bool) -> int:
        """Prompt tokens a step may spend, beyond ``budget``, on rows whose whole
        remaining prompt fits (each prefilled in one step, not chunked): ``burst``
        decode steps' worth at the measured price of a prompt token; 0 where
        ``budget`` is already the full chunk or nothing is priced yet."""
        if not decoding or self.share is None or self.decode_s is None or self.token_s is None or self.token_s <= 0:
            return 0
        return min(self.chunk, int(self.burst * self.decode_s / self.token_s))

    def observe(self, prefill_tokens: int, decoding: bool, seconds: float) -> None:
        """A step that prefilled ``prefill_tokens`` (and decoded, if ``decoding``) took ``seconds``."""
        if seconds <= 0:
            return
        if prefill_tokens == 0:
            if decoding:
                self.decode_s = self._avg(self.decode_s, seconds)
            return
        rest = self.decode_s if decoding and self.decode_s is not None else 0.0
        if decoding and self.decode_s is None:
            return  # cannot tell the chunk's part from the decode's yet
        self.token_s = self._avg(self.token_s, max(seconds - rest, 0.0) / prefill_tokens)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
