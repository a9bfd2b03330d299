"""The ITL-under-prefill leg's numbers, tables and verdict (pure: no servers, no MLX).

``bench.itl_prefill`` records, per server and round, the arrival times of every
streamed chunk of the N decoding streams, alone and while one more request
prefills a long prompt; everything it prints is computed here, so
tests/bench/test_itl_prefill_report.py checks it on made-up arrivals.

Definitions:

- an ITL is the gap between two consecutive content chunks of one stream (the
  first chunk, TTFT, is not one);
- "alone": every ITL of the N streams when nothing else runs;
- "under prefill": the ITLs that overlap the window from the long request's
  send to its first token (its prefill) — a gap that starts before the window
  and ends inside it or after it counts, so one stall spanning the whole
  prefill is one (large) ITL, never none;
- a stream covers the window when it had a chunk at or before the window's
  start and another at or after its end (it decoded across the whole prefill);
  a round where some stream did not is flagged, and its ratio is still shown.

Target (issue #32): Ember's p99 ITL under prefill ≤ 2.0× its p99 alone, the
median over rounds; mlx_lm.server's ratio, measured in the same run, beside it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

SUBJECT = "ember"
REFERENCE = "mlx_lm.server"
BOUND = 2.0  # p99 under prefill / p99 alone


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def itls(arrivals: list[float]) -> list[float]:
    """Gaps between consecutive arrivals of one stream."""
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def window_itls(arrivals: list[float], start: float, end: float) -> list[float]:
    """The gaps of one stream that overlap the window ``(start, end)``."""
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if b > start and a < end]


def covers(arrivals: list[float], start: float, end: float) -> bool:
    """Did the stream decode across the whole window (a chunk at or before its
    start, one at or after its end)?"""
    return bool(arrivals) and arrivals[0] <= start and arrivals[-1] >= end


@dataclass
class RoundResult:
    server: str
    round: int  # 1-based
    alone: list[float]  # ITLs, seconds
    under: list[float]  # ITLs overlapping the prefill window, seconds
    window_s: float  # the long request's send → first token
    covering: int  # streams that decoded across the whole window
    streams: int
    long_prompt_tokens: int = 0
    load: float | None = None  # 1-minute load average at the round's start
    tokens_per_chunk: float | None = None  # the streams' tokens over their chunks (1.0: one chunk per token)

    @property
    def p50_alone(self) -> float | None:
        return percentile(self.alone, 50)

    @property
    def p99_alone(self) -> float | None:
        return percentile(self.alone, 99)

    @property
    def p50_under(self) -> float | None:
        return percentile(self.under, 50)

    @property
    def p99_under(self) -> float | None:
        return percentile(self.under, 99)

    @property
    def ratio(self) -> float | None:
        a, u = self.p99_alone, self.p99_under
        return u / a if a and u is not None else None


def summarize(
    server: str,
    rnd: int,
    alone_streams: list[list[float]],
    under_streams: list[list[float]],
    window: tuple[float, float],
    long_prompt_tokens: int = 0,
    load: float | None = None,
    tokens_per_chunk: float | None = None,
) -> RoundResult:
    """One round from its raw arrivals: per-stream chunk times, both phases."""
    start, end = window
    return RoundResult(
        server=server,
        round=rnd,
        alone=[g for s in alone_streams for g in itls(s)],
        under=[g for s in under_streams for g in window_itls(s, start, end)],
        window_s=end - start,
        covering=sum(covers(s, start, end) for s in under_streams),
        streams=len(under_streams),
        long_prompt_tokens=long_prompt_tokens,
        load=load,
        tokens_per_chunk=tokens_per_chunk,
    )


def median_of(rounds: list[RoundResult], attr: str) -> float | None:
    xs = [v for r in rounds if (v := getattr(r, attr)) is not None]
    return statistics.median(xs) if xs else None


def by_server(rounds: list[RoundResult]) -> dict[str, list[RoundResult]]:
    out: dict[str, list[RoundResult]] = {}
    for r in rounds:
        out.setdefault(r.server, []).append(r)
    return out


@dataclass
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measured by this run


def verdict(rounds: list[RoundResult], subject: str = SUBJECT, reference: str = REFERENCE) -> Verdict:
    target = f"{subject}: p99 ITL under a long prefill ≤ {BOUND:.1f}× alone (median of rounds)"
    servers = by_server(rounds)
    mine = servers.get(subject, [])
    ratio = median_of(mine, "ratio")
    if ratio is None:
        return Verdict(target, "no ITLs in the window" if mine else f"no {subject} rounds", None)
    uncovered = sum(r.covering < r.streams for r in mine)
    measured = f"{ratio:.2f}×"
    ref = median_of(servers.get(reference, []), "ratio")
    if ref is not None:
        measured += f" ({reference}: {ref:.2f}×)"
    if uncovered:
        measured += f"; {uncovered}/{len(mine)} rounds had a stream end inside the window"
    return Verdict(target, measured, ratio <= BOUND)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.1f}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def round_table(rounds: list[RoundResult]) -> str:
    head = (
        "| server | round | load | ITL alone p50 / p99 ms (n) | ITL under prefill p50 / p99 ms (n) "
        "| p99 under / alone | prefill window s (prompt tokens) | streams covering | tokens/chunk |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        load = "—" if r.load is None else f"{r.load:.2f}"
        lines.append(
            f"| {r.server} | {r.round} | {load} | {_ms(r.p50_alone)} / {_ms(r.p99_alone)} ({len(r.alone)}) "
            f"| {_ms(r.p50_under)} / {_ms(r.p99_under)} ({len(r.under)}) | {_x(r.ratio)} "
            f"| {r.window_s:.2f} ({r.long_prompt_tokens}) | {r.covering}/{r.streams} "
            f"| {'—' if r.tokens_per_chunk is None else f'{r.tokens_per_chunk:.2f}'} |"
        )
    return "\n".join(lines)


def summary_table(rounds: list[RoundResult], subject: str = SUBJECT, reference: str = REFERENCE) -> str:
    """Medians over rounds per server, and Ember against mlx_lm.server."""
    servers = by_server(rounds)
    names = sorted(servers, key=lambda s: (s != subject, s))
    lines = [
        "| server | p50 alone ms | p99 alone ms | p50 under ms | p99 under ms | p99 ratio | prefill window s |",
        "|---|---|---|---|---|---|---|",
    ]
    med: dict[str, dict[str, float | None]] = {}
    for n in names:
        rs = servers[n]
        med[n] = {a: median_of(rs, a) for a in ("p50_alone", "p99_alone", "p50_under", "p99_under", "ratio")}
        m = med[n]
        lines.append(
            f"| {n} | {_ms(m['p50_alone'])} | {_ms(m['p99_alone'])} | {_ms(m['p50_under'])} "
            f"| {_ms(m['p99_under'])} | {_x(m['ratio'])} | {median_of(rs, 'window_s') or 0:.2f} |"
        )
    if subject in med and reference in med:
        e, r = med[subject], med[reference]

        def rel(a: float | None, b: float | None) -> str:
            return _x(a / b) if a is not None and b else "—"

        lines.append(
            f"| {subject} / {reference} | {rel(e['p50_alone'], r['p50_alone'])} "
            f"| {rel(e['p99_alone'], r['p99_alone'])} | {rel(e['p50_under'], r['p50_under'])} "
            f"| {rel(e['p99_under'], r['p99_under'])} | {rel(e['ratio'], r['ratio'])} "
            f"| {rel(median_of(servers[subject], 'window_s'), median_of(servers[reference], 'window_s'))} |"
        )
    return "\n".join(lines)


def verdict_table(v: Verdict) -> str:
    word = "not measured here" if v.met is None else ("**met**" if v.met else "**NOT MET**")
    return "\n".join(["| target | measured | verdict |", "|---|---|---|", f"| {v.target} | {v.measured} | {word} |"])


def report(
    rounds: list[RoundResult], *, command: str, commit: str, load_before: str, load_after: str, notes: str = ""
) -> str:
    parts = [
        "## ITL of running streams while another request prefills a long prompt",
        "",
        f"- command: `{command}`",
        f"- commit: {commit}",
        f"- load average (1/5/15 min) before: {load_before}; after: {load_after}",
    ]
    if notes:
        parts.append(f"- {notes}")
    parts += [
        "",
        "### Every round",
        "",
        round_table(rounds),
        "",
        "### Medians over rounds",
        "",
        summary_table(rounds),
        "",
        "### Verdict",
        "",
        verdict_table(verdict(rounds)),
        "",
    ]
    return "\n".join(parts)
