"""The agent-session benchmark's verdicts and tables (pure: no servers, no MLX).

``bench.agent_session`` collects one ``Turn`` per (server, turn); everything it
prints is computed here, so tests/bench/test_agent_session_report.py can check
the verdicts on made-up numbers. Targets (issue #32), over all rounds:

- session wall time ≥ 2.0× every peer's;
- every turn's cached prefix covers the previous prompt (after the restart too);
- warm-turn TTFT ≤ 0.8× the best peer's (median over the warm turns);
- decode ≥ 2× every peer's on the quoting turns (median over turns);
- greedy replies identical to mlx_lm.server's on every turn.

Adaptive γ's ≥ 0.98× and the ITL bound are measured elsewhere (the fake
machine in tests/ember/test_spec_isolated.py; the ITL leg, when run) and are
reported as such, never as met here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

REFERENCE = "mlx_lm.server"  # whose greedy replies the others must match
SUBJECT = "ember"


@dataclass
class Turn:
    server: str
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not say
    ttft_s: float
    decode_tps: float | None
    completion_tokens: int
    wall_s: float
    reply: str
    after_restart: bool = False  # the first turn after the servers restarted
    split: dict[str, float] = field(default_factory=dict)  # where the turn's time went (seconds)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def by_server(turns: list[Turn]) -> dict[str, list[Turn]]:
    out: dict[str, list[Turn]] = {}
    for t in turns:
        out.setdefault(t.server, []).append(t)
    for rows in out.values():
        rows.sort(key=lambda t: t.turn)
    return out


def totals(rows: list[Turn]) -> dict[str, float | None]:
    warm = [t.ttft_s for t in rows if t.turn > 1 and not t.after_restart]  # the restart turn is not warm
    restart = [t.ttft_s for t in rows if t.after_restart]
    return {
        "session_s": sum(t.wall_s for t in rows),
        "ttft_sum_s": sum(t.ttft_s for t in rows),
        "warm_ttft_median_s": median(warm),
        "restart_ttft_s": restart[0] if restart else None,
        "decode_tps_median": median([t.decode_tps for t in rows if t.decode_tps is not None]),
    }


BOUNDARY_SLACK = 2  # the chat template re-renders the turn boundary: mlx_lm.server shares 1 token less too


def covered(rows: list[Turn]) -> tuple[int, int]:
    """Turns (after the first) whose cached prefix reached the previous prompt's
    length, less the template's turn-boundary tokens (``BOUNDARY_SLACK``)."""
    ok = n = 0
    for prev, t in zip(rows, rows[1:]):
        n += 1
        if t.cached_tokens is not None and t.cached_tokens >= prev.prompt_tokens - BOUNDARY_SLACK:
            ok += 1
    return ok, n


def identical(rows: list[Turn], ref: list[Turn]) -> tuple[int, int]:
    want = {t.turn: t.reply for t in ref}
    same = sum(1 for t in rows if t.turn in want and t.reply == want[t.turn])
    return same, sum(1 for t in rows if t.turn in want)


@dataclass
class Verdict:
    target: str
    measured: str
    met: bool | None  # None: not measured by this run


def verdicts(turns: list[Turn], subject: str = SUBJECT, reference: str = REFERENCE) -> list[Verdict]:
    servers = by_server(turns)
    mine = servers.get(subject, [])
    peers = {k: v for k, v in servers.items() if k != subject}
    tot = {k: totals(v) for k, v in servers.items()}
    out: list[Verdict] = []
    if not mine or not peers:
        return [Verdict("a side-by-side run", "no peer or no Ember rows", False)]
    me = tot[subject]

    mine_s = me["session_s"] or 0.0
    ratios = {p: (tot[p]["session_s"] or 0.0) / mine_s for p in peers if mine_s}
    out.append(
        Verdict(
            "session wall time ≥ 2.0× every peer",
            ", ".join(f"{ratios[p]:.2f}× {p}" for p in sorted(ratios)),
            bool(ratios) and min(ratios.values()) >= 2.0,
        )
    )
    ok, n = covered(mine)
    out.append(Verdict("every turn's cached prefix covers the previous prompt", f"{ok}/{n}", n > 0 and ok == n))

    warm_peers = [w for p in peers if (w := tot[p]["warm_ttft_median_s"]) is not None and w > 0]
    best_peer = min(warm_peers, default=None)
    mw = me["warm_ttft_median_s"]
    if best_peer and mw is not None:
        out.append(
            Verdict(
                "warm-turn TTFT ≤ 0.8× the best peer's (median)",
                f"{mw / best_peer:.2f}× ({mw:.2f} s vs {best_peer:.2f} s)",
                mw <= 0.8 * best_peer,
            )
        )
    dec = {}
    for p in peers:
        pd, md = tot[p]["decode_tps_median"], me["decode_tps_median"]
        if pd and md:
            dec[p] = md / pd
    out.append(
        Verdict(
            "decode ≥ 2× every peer on the quoting turns (median)",
            ", ".join(f"{dec[p]:.2f}× {p}" for p in sorted(dec)) or "no decode measured",
            bool(dec) and min(dec.values()) >= 2.0,
        )
    )
    if reference in servers:
        for name, rows in servers.items():
            if name == reference:
                continue
            same, n = identical(rows, servers[reference])
            out.append(Verdict(f"{name}: greedy replies identical to {reference}", f"{same}/{n}", n > 0 and same == n))
    out.append(Verdict("adaptive γ ≥ 0.98× plain (chat/edit/copy/agent, b1/4/8)", "not in this run", None))
    return out


def turn_table(turns: list[Turn], reference: str = REFERENCE) -> str:
    servers = by_server(turns)
    names = sorted(servers, key=lambda s: (s != SUBJECT, s))
    ref = {t.turn: t.reply for t in servers.get(reference, [])}
    head = "| turn | " + " | ".join(f"{n}: prompt / cached / TTFT s / tok/s / same" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    nturns = max((t.turn for t in turns), default=0)
    for k in range(1, nturns + 1):
        cells = []
        mark = ""
        for n in names:
            t = next((t for t in servers[n] if t.turn == k), None)
            if t is None:
                cells.append("—")
                continue
            mark = mark or ("restart → " if t.after_restart else "")
            same = "ref" if n == reference else ("yes" if ref.get(k) == t.reply else "NO")
            cached = "?" if t.cached_tokens is None else str(t.cached_tokens)
            tps = "—" if t.decode_tps is None else f"{t.decode_tps:.1f}"
            cells.append(f"{t.prompt_tokens} / {cached} / {t.ttft_s:.2f} / {tps} / {same}")
        lines.append(f"| {mark}{k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def totals_table(turns: list[Turn], subject: str = SUBJECT) -> str:
    servers = by_server(turns)
    tot = {k: totals(v) for k, v in servers.items()}
    peers = sorted(p for p in servers if p != subject)
    cols = [subject, *peers] if subject in servers else peers
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def fmt(v: float | None, unit: str) -> str:
        return "—" if v is None else f"{v:.2f}{unit}"

    for key, label, unit in [
        ("session_s", "session wall time", " s"),
        ("ttft_sum_s", "sum of TTFT", " s"),
        ("warm_ttft_median_s", "warm-turn TTFT, median", " s"),
        ("restart_ttft_s", "TTFT of the turn after the restart", " s"),
        ("decode_tps_median", "decode tok/s, median", ""),
    ]:
        lines.append(f"| {label} | " + " | ".join(fmt(tot[c][key], unit) for c in cols) + " |")
    return "\n".join(lines)


def split_table(turns: list[Turn], subject: str = SUBJECT) -> str:
    """Where each of the subject's turns went: prefill of its new tokens split
    into weights and attention (the probe's share), decode, and restore (the
    turn after the restart: TTFT over what a warm turn of that size costs)."""
    rows = [t for t in by_server(turns).get(subject, []) if t.split]
    if not rows:
        return ""
    keys = ["new_tokens", "prefill_weights_s", "prefill_attention_s", "attention_share"]
    keys += ["attention_gemm_s"] if any("attention_gemm_s" in t.split for t in rows) else []
    keys += ["decode_s", "restore_s"]
    lines = ["| turn | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for t in rows:
        cells = []
        for k in keys:
            v = t.split.get(k)
            cells.append("—" if v is None else (str(int(v)) if k == "new_tokens" else f"{v:.2f}"))
        lines.append(f"| {t.turn} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_turn(
    t: Turn, attention_share: float, warm_s_per_token: float | None, gemm_share: float | None = None
) -> dict[str, float]:
    """A turn's time apart: its TTFT is the prefill of the tokens the cache
    missed (plus a restore after the restart), split by the probe's attention
    share at the turn's context; decode is the rest of its wall time.
    ``gemm_share``: the probe's two GEMMs (QK^T and PV, as the attention runs
    them) over its whole attention — the part no exact attention skips; the
    rest is the softmax and the masking around them."""
    new = t.prompt_tokens - (t.cached_tokens or 0)
    prefill = t.ttft_s
    restore = 0.0
    if t.after_restart and warm_s_per_token is not None:
        expected = warm_s_per_token * max(new, 1)
        restore = max(0.0, prefill - expected)
        prefill -= restore
    return {
        "new_tokens": float(new),
        "prefill_weights_s": prefill * (1 - attention_share),
        "prefill_attention_s": prefill * attention_share,
        "attention_share": attention_share,
        **({} if gemm_share is None else {"attention_gemm_s": prefill * attention_share * gemm_share}),
        "decode_s": max(0.0, t.wall_s - t.ttft_s),
        "restore_s": restore,
    }


def verdict_table(vs: list[Verdict]) -> str:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for v in vs:
        word = "not measured here" if v.met is None else ("**met**" if v.met else "**NOT MET**")
        lines.append(f"| {v.target} | {v.measured} | {word} |")
    return "\n".join(lines)
