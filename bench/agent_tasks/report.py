"""The harness's Markdown: pass counts per client x model with failures attributed, then every session."""

from __future__ import annotations

from collections.abc import Sequence

from bench.agent_tasks.attribute import Session


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def counts_table(sessions: Sequence[Session]) -> str:
    rows = [
        "| client | model | passed | failed: model's choice | failed: Ember's fault | failed: time cap "
        "| Ember faults (all sessions) |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    keys = list(dict.fromkeys((s.client, s.model) for s in sessions))
    for client, model in keys:
        mine = [s for s in sessions if (s.client, s.model) == (client, model)]
        passed = sum(s.passed for s in mine)
        by = {k: sum(1 for s in mine if s.outcome == k) for k in ("model", "ember", "time cap")}
        faults = sum(len(s.ember) for s in mine)
        rows.append(
            f"| {client} | `{model}` | {passed}/{len(mine)} | {by['model']} | {by['ember']} | {by['time cap']} "
            f"| {faults} |"
        )
    return "\n".join(rows)


def sessions_table(sessions: Sequence[Session]) -> str:
    rows = [
        "| client | model | task | result | turns | tool calls | prompt tok | cached tok | wall s | why (not Ember) "
        "| Ember's fault |"
    ]
    rows.append("|---|---|---|---|--:|--:|--:|--:|--:|---|---|")
    for s in sessions:
        result = "pass" if s.passed else f"FAIL ({s.outcome})"
        ember = "; ".join(s.ember)
        rows.append(
            f"| {s.client} | `{s.model}` | {s.task} | {result} | {s.turns} | {s.tool_calls} | {s.prompt_tokens} | "
            f"{s.cached_tokens} | {s.wall_s:.0f} | {_cell(s.reason)} | {_cell(ember)} |"
        )
    return "\n".join(rows)


def report(sessions: Sequence[Session], header: str = "") -> str:
    parts = [header] if header else []
    parts += ["## Pass counts\n\n" + counts_table(sessions), "## Sessions\n\n" + sessions_table(sessions)]
    faults = [(s, f) for s in sessions for f in s.ember]
    if faults:
        parts.append(
            "## Ember's faults\n\n" + "\n".join(f"- {s.client} / `{s.model}` / {s.task}: {_cell(f)}" for s, f in faults)
        )
    return "\n\n".join(parts) + "\n"
