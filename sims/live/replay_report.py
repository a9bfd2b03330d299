"""The replay's report: latency percentiles, throughput and the cached-token
ratio of a run's samples as Markdown, and the TTFT-over-time plot with the
restarts and flushes marked (``sims.live.replay`` runs the trace)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sims.trace import Trace


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.1f}"


@dataclass
class Sample:
    """One request as the client saw it; times in seconds from the run's start."""

    id: int
    session: str
    start: float
    end: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    ok: bool = False


@dataclass
class Mark:
    """A restart or flush, as it happened (or was skipped)."""

    t: float
    kind: str  # crash, graceful, flush
    note: str = ""


def summarize(samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    itl = [g for s in ok for g in s.itl_s]
    span = (max(s.end for s in samples) - min(s.start for s in samples)) if samples else 0.0
    tokens = sum(s.completion_tokens for s in ok)
    prompt = sum(s.prompt_tokens for s in ok if s.cached_tokens is not None)
    cached = sum(s.cached_tokens or 0 for s in ok)
    errors: dict[str, int] = {}
    for s in samples:
        for e in s.errors:
            key = e.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(samples),
        "ok": len(ok),
        "failed": len(samples) - len(ok),
        "errors": errors,
        "ttft": {p: pct(ttft, p) for p in (50, 95, 99)},
        "itl": {p: pct(itl, p) for p in (50, 95, 99)},
        "span_s": span,
        "output_tokens": tokens,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
        "cached_ratio": cached / prompt if prompt else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
    }


def report_markdown(
    url: str, trace: Trace, scale: float, samples: list[Sample], marks: list[Mark], plot_name: str | None
) -> str:
    m = summarize(samples)
    lines = [
        f"# Replay of `{trace.header.kind}` trace against {url}",
        "",
        f"- trace: {trace.header.kind} (seed {trace.header.seed}), {len(trace.requests)} requests over {trace.duration_s:.1f} s, time scale {scale}",
        f"- answered: {m['ok']} of {m['requests']}, failed {m['failed']}; errors (every attempt): {m['errors'] or 'none'}",
        f"- wall time {m['span_s']:.1f} s; throughput {m['tokens_per_s']:.1f} output tokens/s, {m['requests_per_s']:.2f} requests/s",
        "- cached-token ratio: "
        + (
            "not reported by the server"
            if m["cached_ratio"] is None
            else f"{m['cached_ratio']:.1%} ({m['cached_tokens']} of {m['prompt_tokens']} prompt tokens)"
        ),
        "",
        "| latency (ms) | p50 | p95 | p99 |",
        "|---|---|---|---|",
        f"| TTFT | {_ms(m['ttft'][50])} | {_ms(m['ttft'][95])} | {_ms(m['ttft'][99])} |",
        f"| inter-token | {_ms(m['itl'][50])} | {_ms(m['itl'][95])} | {_ms(m['itl'][99])} |",
        "",
        "TTFT counts from the first time a request was sent (failed attempts included); inter-token latency is the gap between streamed chunks.",
    ]
    if marks:
        lines += ["", "| t (s) | event | outcome |", "|---|---|---|"]
        lines += [f"| {k.t:.1f} | {k.kind} | {k.note} |" for k in sorted(marks, key=lambda k: k.t)]
    if plot_name:
        lines += ["", f"![TTFT over the run]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(samples: list[Sample], marks: list[Mark], path: str, title: str) -> bool:
    """Write the TTFT plot to ``path``; True."""
    import matplotlib  # the bench extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    timed = [(s, s.ttft_s) for s in samples if s.ok and s.ttft_s is not None]
    hit = [(s, ttft) for s, ttft in timed if (s.cached_tokens or 0) > 0]
    miss = [(s, ttft) for s, ttft in timed if not (s.cached_tokens or 0) > 0]
    failed = [s for s in samples if not s.ok]
    ax.scatter([s.start for s, _ in miss], [t * 1000 for _, t in miss], s=10, c="tab:blue", label="no cached prefix")
    ax.scatter([s.start for s, _ in hit], [t * 1000 for _, t in hit], s=10, c="tab:green", label="cached prefix")
    if failed:
        ax.scatter([s.start for s in failed], [1.0] * len(failed), s=14, c="black", marker="x", label="failed")
    colors = {"crash": "tab:red", "graceful": "tab:orange", "flush": "tab:purple"}
    for kind in ("crash", "graceful", "flush"):
        ts = [k.t for k in marks if k.kind == kind]
        for i, t in enumerate(ts):
            ax.axvline(
                t,
                color=colors[kind],
                linestyle="--" if kind == "flush" else "-",
                linewidth=1,
                label=kind if i == 0 else None,
            )
    ax.set_yscale("log")
    ax.set_xlabel("request start (s into the run)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
