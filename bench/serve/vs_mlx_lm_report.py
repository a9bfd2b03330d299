"""The report of ``bench.serve.vs_mlx_lm``: per-leg medians and Ember/mlx-lm ratios
as Markdown against the targets, and the ratio chart."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


@dataclass
class Results:
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average at the start of each round, and at the end

    def add(self, leg: str, who: str, value: float | None) -> None:
        if value is not None:
            self.rows.setdefault(leg, {}).setdefault(who, []).append(value)

    def med(self, leg: str, who: str) -> float | None:
        return median(self.rows.get(leg, {}).get(who, []))


def machine_line() -> str:
    import importlib.metadata as md

    vers = {p: md.version(p) for p in ("mlx", "mlx-lm", "ember-mlx")}
    blas = "OpenBLAS preloaded" if Path(OPENBLAS).exists() else "reference BLAS"
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in vers.items())
        + f", {blas}"
    )


# Issue 24's targets (Ember / mlx_lm.server unless noted).
TARGETS = {
    "decode1": (">=", 1.0),
    "agg8": (">=", 1.3),
    "ttft1k_warm": ("<=", 0.7),
}
BARE_TARGET = 0.97  # single stream vs the bare mlx-lm decode loop (prefill excluded)
RESTART_TARGET = 0.02  # restart TTFT as a fraction of Ember's own cold TTFT


def command_line(args: argparse.Namespace) -> str:
    """The full command that reproduces this run."""
    weights = os.environ.get("EMBER_WEIGHTS", "")
    parts = [f"EMBER_WEIGHTS={weights}"] if weights else []  # both servers get the directory it selects
    parts += ["python -m bench.serve.vs_mlx_lm", f"--model {args.model}", f"--rounds {args.rounds}"]
    if args.legs:
        parts.append(f"--legs {args.legs}")
    if getattr(args, "ember_flags", ""):
        parts.append(f"--ember-flags '{args.ember_flags}'")
    if getattr(args, "peer_weights", None):
        parts.append(f"--peer-weights {args.peer_weights}")
    for flag, value, default in (("--decode-tokens", "decode_tokens", 128), ("--agg-tokens", "agg_tokens", 64)):
        if getattr(args, value, default) != default:
            parts.append(f"{flag} {getattr(args, value)}")
    parts += [
        f"--gamma {args.gamma}",
        f"--long-tokens {args.long_tokens}",
        f"--long-rounds {args.long_rounds}",
        f"--out {args.out}",
    ]
    return " ".join(parts)


def _verdict(values: list[float | None], op: str, bound: float) -> str:
    ok = [(v >= bound if op == ">=" else v <= bound) for v in values if v is not None]
    if not ok:
        return "not measured"
    # Both statistics must agree; on a noisy box they sometimes do not.
    return "MET" if all(ok) else ("NOT MET" if not any(ok) else "inconclusive")


def target_table(res: Results, args: argparse.Namespace) -> list[str]:
    """The issue-24 targets, each with the ratio of medians and the paired ratio."""

    def fmt(x, unit="×"):
        return "–" if x is None else f"{x:.3g}{unit}"

    def paired(leg: str, a: str, b: str) -> float | None:
        rows = res.rows.get(leg, {})
        return median([x / y for x, y in zip(rows.get(a, []), rows.get(b, [])) if y])

    lines = [
        "| issue 24 target | Ember | reference | ratio of medians | paired (median of per-round ratios) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "decode1": "single stream vs mlx_lm.server",
        "agg8": "8-stream aggregate vs mlx_lm.server",
        "ttft1k_warm": "warm TTFT (~1k tokens) vs mlx_lm.server",
    }
    for leg, (op, bound) in TARGETS.items():
        e, m = res.med(leg, "ember"), res.med(leg, "mlx-lm")
        ratio, pair = (e / m if e and m else None), paired(leg, "ember", "mlx-lm")
        unit = " ms" if leg.startswith("ttft") else " tok/s"
        lines.append(
            f"| {names[leg]} {op} {bound}× | {fmt(e, unit)} | {fmt(m, unit)} | {fmt(ratio)} | {fmt(pair)} "
            f"| {_verdict([ratio, pair], op, bound)} |"
        )
    bare = res.rows.get("bare", {})
    per_round = [max(a, b) for a, b in zip(bare.get("mlx_lm.stream_generate", []), bare.get("1 thread", []))]
    if per_round:
        e, b = res.med("decode1", "ember"), median(per_round)
        pair = median([x / y for x, y in zip(res.rows.get("decode1", {}).get("ember", []), per_round) if y])
        ratio = e / b if e and b else None
        lines.append(
            f"| single stream vs the bare `mlx_lm.stream_generate` loop (faster of default / 1 thread, per round) "
            f">= {BARE_TARGET}× | {fmt(e, ' tok/s')} | {fmt(b, ' tok/s')} | {fmt(ratio)} | {fmt(pair)} "
            f"| {_verdict([ratio, pair], '>=', BARE_TARGET)} |"
        )
    if res.rows.get("restart", {}).get("ember"):
        rc = res.med("restart_vs_cold", "ember")
        lines.append(
            f"| restart TTFT vs Ember's own cold TTFT ({args.long_tokens:,}-token prompt, "
            f"{int(res.med('restart_cached_tokens', 'ember') or 0):,} cached) <= {RESTART_TARGET:.0%} "
            f"| {fmt(res.med('restart', 'ember'), ' ms')} | {fmt(res.med('ttft8k', 'ember'), ' ms')} "
            f"| {fmt(rc and rc * 100, '%')} | – | {_verdict([rc], '<=', RESTART_TARGET)} |"
        )
    load = res.load
    if load:
        lines += [
            "",
            f"1-minute load average on the 2-core machine at each round's start and at the end: "
            f"{', '.join(f'{x:.1f}' for x in load)} (median {statistics.median(load):.1f}).",
        ]
    return lines


def report(res: Results, args: argparse.Namespace) -> str:
    def fmt(x, unit=""):
        return "–" if x is None else (f"{x:.3g}{unit}" if abs(x) < 1000 else f"{x:,.0f}{unit}")

    lines = [
        "# Ember vs mlx_lm.server, side by side",
        "",
        f"Command: `{command_line(args)}`",
        "",
        f"Machine: {machine_line()}. Model: `{args.model}`. {args.rounds} rounds, alternating which server goes first; medians.",
        "Absolute numbers on this shared machine are noisy: quote the ratios.",
        "",
        *target_table(res, args),
        "",
        f"The long-prompt legs (`ttft8k`, `restart`) used a {args.long_tokens:,}-token prompt in "
        f"{min(args.long_rounds, args.rounds)} round(s).",
        "",
        "| leg | unit | Ember | mlx_lm.server | Ember / mlx-lm (of medians) | paired (median of per-round ratios) | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    units = {
        "decode1": "tok/s",
        "agg4": "tok/s",
        "agg8": "tok/s",
        "ttft1k_cold": "ms",
        "ttft1k_warm": "ms",
        "ttft8k": "ms",
        "restart": "ms",
    }
    ratios: dict[str, float] = {}
    for leg, unit in units.items():
        e, m = res.med(leg, "ember"), res.med(leg, "mlx-lm")
        ratio = e / m if e and m else None
        pairs = [
            a / b for a, b in zip(res.rows.get(leg, {}).get("ember", []), res.rows.get(leg, {}).get("mlx-lm", [])) if b
        ]
        paired = median(pairs)
        if ratio is not None:
            ratios[leg] = ratio
        target = TARGETS.get(leg)
        met = _verdict([ratio, paired], *target) if target and ratio is not None else ""
        lines.append(
            f"| {leg} | {unit} | {fmt(e)} | {fmt(m)} | {fmt(ratio, '×')} | {fmt(paired, '×')} | {target[0] + ' ' + str(target[1]) + '×' if target else ''} | {met} |"
        )
    lines += ["", "## Restart leg", ""]
    if res.rows.get("restart"):
        rc = res.med("restart_vs_cold", "ember")
        lines += [
            f"- Ember: restart TTFT {fmt(res.med('restart', 'ember'), ' ms')} vs its cold TTFT {fmt(res.med('ttft8k', 'ember'), ' ms')} "
            f"= {fmt(rc and rc * 100, '%')} of cold (target ≤ 2%); cached tokens after restart {fmt(res.med('restart_cached_tokens', 'ember'))} "
            f"of {fmt(res.med('restart_prompt_tokens', 'ember'))}; flush durable in {fmt((res.med('restart_flush_durable', 'ember') or 0) * 100, '%')} of rounds; "
            f"exit code on SIGTERM {fmt(res.med('restart_exit_code', 'ember'))}; ready after respawn {fmt(res.med('restart_ready_s', 'ember'), ' s')}.",
            f"- mlx_lm.server: restart TTFT {fmt(res.med('restart', 'mlx-lm'), ' ms')} = {fmt((res.med('restart_vs_cold', 'mlx-lm') or 0) * 100, '%')} of its cold TTFT; "
            f"cached tokens after restart {fmt(res.med('restart_cached_tokens', 'mlx-lm'))}.",
        ]
        restart_e, restart_m = res.med("restart", "ember"), res.med("restart", "mlx-lm")
        if restart_e and restart_m:
            ratios["restart"] = restart_e / restart_m
    if res.rows.get("tier_decode"):
        on, off = res.med("tier_decode", "on"), res.med("tier_decode", "off")
        pairs = [
            a / b for a, b in zip(res.rows["tier_decode"].get("on", []), res.rows["tier_decode"].get("off", [])) if b
        ]
        lines += [
            "",
            "## SSD tier on vs off (Ember)",
            "",
            "Two fresh Ember servers that serve only this leg (a 2000-token request, then the decode run, so the tier-on server has a write-behind snapshot pending during the decode).",
            "",
            f"Decode {fmt(on, ' tok/s')} with the tier vs {fmt(off, ' tok/s')} without: **{fmt(on / off if on and off else None, '×')}**, paired {fmt(median(pairs), '×')} (target ≥ 0.98×).",
        ]
        if on and off:
            ratios["tier on/off"] = on / off
    if res.rows.get("spec_decode"):
        ep, es = res.med("spec_decode", "ember-plain"), res.med("spec_decode", "ember-spec")
        mp, ms = res.med("spec_decode", "mlx-lm-plain"), res.med("spec_decode", "mlx-lm-spec")
        lines += [
            "",
            f"## Speculation (draft model tiny-draft, γ={args.gamma})",
            "",
            f"- Ember: {fmt(es, ' tok/s')} with vs {fmt(ep, ' tok/s')} without = **{fmt(es / ep if es and ep else None, '×')}**",
            f"- mlx_lm.server: {fmt(ms, ' tok/s')} with vs {fmt(mp, ' tok/s')} without = **{fmt(ms / mp if ms and mp else None, '×')}**",
        ]
        if es and ep:
            ratios["spec speedup"] = es / ep
    if res.rows.get("bare"):
        b2 = res.med("bare", "mlx_lm.stream_generate")
        b1 = res.med("bare", "1 thread")
        b = max(x for x in (b1, b2, 0.0) if x is not None) or None
        e = res.med("decode1", "ember")
        lines += [
            "",
            "## Single-stream ceiling",
            "",
            f"Bare `mlx_lm.stream_generate` loop in its own process: {fmt(b2, ' tok/s')} with OpenBLAS's default threads, "
            f"{fmt(b1, ' tok/s')} with `OPENBLAS_NUM_THREADS=1`; the faster is the ceiling. "
            f"Ember single-stream over HTTP {fmt(e, ' tok/s')} = **{fmt(e / b if e and b else None, '×')}** of it (target ≥ 0.97×).",
        ]
        if e and b:
            ratios["vs bare loop"] = e / b
        h2, h1 = res.med("bare_http", "bare-http"), res.med("bare_http", "bare-http-1")
        h = max(x for x in (h1, h2, 0.0) if x is not None) or None
        if h:
            lines += [
                "",
                f"The same loop behind the thinnest streaming server (`bench/serve/bare_server.py`: "
                f"`stream_generate` on a thread, one SSE event per token), measured with the same client as "
                f"the two servers: {fmt(h2, ' tok/s')} with default threads, {fmt(h1, ' tok/s')} with one. "
                f"Ember = **{fmt(e / h if e else None, '×')}** of the faster; mlx_lm.server "
                f"{fmt((res.med('decode1', 'mlx-lm') or 0) / h, '×')}. The in-process loop pays no HTTP hop "
                "and has no client beside it on the two cores; this one does, like the servers.",
            ]
            if e:
                ratios["vs bare loop behind HTTP"] = e / h
    lines += ["", "## Raw samples", "", "```json", json.dumps(res.rows, indent=1, default=float), "```", ""]
    lines += res.notes
    res.notes = [json.dumps(ratios)]
    return "\n".join(lines)


def chart(ratios: dict[str, float], path: Path) -> bool:
    """Write the ratio chart to ``path``; True."""
    import matplotlib  # the bench extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(ratios)
    ax.barh(names, [ratios[n] for n in names], color="#d9642b")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("ratio (Ember / mlx_lm.server, or as labelled)")
    ax.set_title("Ember vs mlx_lm.server, medians (lower is better for TTFT/restart)")
    for i, n in enumerate(names):
        ax.text(ratios[n], i, f" {ratios[n]:.2f}×", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
