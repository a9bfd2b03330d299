"""The report of ``bench.serve.engine``: the results as a Markdown table, written
between markers into docs/bench/engine.md (the rest of the page is kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BEGIN, END = (
    "<!-- engine-report:begin -->",
    "<!-- engine-report:end -->",
)  # not a bench.docs block: this bench writes its page itself


def table(res: dict[str, Any], ref: dict[str, Any] | None, command: str) -> str:
    m, s = res["machine"], res["single"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg'] or [])}, at end "
        f"{', '.join(f'{x:.2f}' for x in m.get('loadavg_end') or [])}.",
        f"Versions: Python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}; device {m['device']}; "
        f"BLAS {m['blas']}. Model: `{res['model']}`.",
        "",
        "| single-stream decode (tok/s) | bare mlx-lm | Engine | Engine / bare |",
        "|---|---|---|---|",
        f"| median of {len(s['bare'])} alternating rounds | {s['bare_med']:.0f} | {s['engine_med']:.0f} | **{s['ratio']:.3f}** |",
        f"| all rounds | {', '.join(f'{x:.0f}' for x in s['bare'])} | {', '.join(f'{x:.0f}' for x in s['engine'])} | |",
        f"| median time between tokens, ms (median over rounds) | {s['bare_gap_ms']:.3f} | {s['engine_gap_ms']:.3f} "
        f"| {s['bare_gap_ms'] / s['engine_gap_ms']:.3f} |",
        f"| process CPU ms per token (median) | {s['bare_cpu_ms']:.2f} | {s['engine_cpu_ms']:.2f} "
        f"| {s['bare_cpu_ms'] / s['engine_cpu_ms']:.3f} |",
    ]
    if s.get("bare1"):
        best = min(s["ratio"], s["ratio1"])
        lines += [
            "",
            f"The bare loop ran at OpenBLAS's default ({s['blas_default_threads']} threads, above) and, in the same "
            "rounds, at 1 thread (the setting the Engine picks for a 1-row decode step, `engine.mlx.blas`):",
            "",
            "| bare loop on 1 OpenBLAS thread (tok/s) | bare mlx-lm | Engine | Engine / bare |",
            "|---|---|---|---|",
            f"| median of {len(s['bare1'])} rounds | {s['bare1_med']:.0f} | {s['engine_med']:.0f} | **{s['ratio1']:.3f}** |",
            f"| all rounds | {', '.join(f'{x:.0f}' for x in s['bare1'])} | | |",
            "",
            f"Engine against the faster of the two bare settings: **{best:.3f}**.",
        ]
    if s.get("backend_alone"):
        ceiling = max(s["bare_med"], s.get("bare1_med") or 0.0)
        lines += [
            "",
            "The Engine's own backend driven in a plain loop on its MLX thread (step, then run-ahead, as "
            "`MLXThread` does), with no Scheduler or event loop between tokens, in the same rounds:",
            "",
            "| | median tok/s | all rounds | / faster bare loop | Engine / backend alone |",
            "|---|---|---|---|---|",
            f"| backend alone | {s['backend_alone_med']:.0f} | "
            f"{', '.join(f'{x:.0f}' for x in s['backend_alone'])} | **{s['backend_alone_med'] / ceiling:.3f}** | "
            f"**{s['engine_med'] / s['backend_alone_med']:.3f}** |",
        ]
    c = res["cpu"]
    lines += [
        "",
        "| CPU ms per decoded token (median of 3) | caller / event loop | MLX thread (step + run-ahead) | MLX + BLAS workers | total |",
        "|---|---|---|---|---|",
        f"| bare mlx-lm | {c['bare_caller']:.3f} | (the caller) | {c['bare_workers']:.3f} | {c['bare_caller'] + c['bare_workers']:.3f} |",
        f"| Engine | {c['loop']:.3f} | {c['mlx_thread']:.3f} | {c['workers']:.3f} | {c['loop'] + c['mlx_thread'] + c['workers']:.3f} |",
    ]
    if "aggregate" in res:
        lines += [
            "",
            "| concurrent requests | Engine aggregate tok/s | mlx_lm.batch_generate tok/s | Engine / mlx-lm |",
            "|---|---|---|---|",
        ]
        for conc, row in res["aggregate"].items():
            lines.append(
                f"| {conc} | {row['engine']:.0f} | {row['mlx_lm_batch']:.0f} | {row['engine'] / row['mlx_lm_batch']:.2f} |"
            )
    if ref is not None:
        rs = ref["single"]
        lines += [
            "",
            "| BLAS | bare decode tok/s | Engine decode tok/s | mlx-lm prefill tok/s (1k prompt) |",
            "|---|---|---|---|",
            f"| OpenBLAS (preloaded) | {s['bare_med']:.0f} | {s['engine_med']:.0f} | {res['prefill_tps']:.0f} |",
            f"| reference (no preload) | {rs['bare_med']:.0f} | {rs['engine_med']:.0f} | {ref['prefill_tps']:.0f} |",
            f"| OpenBLAS speedup | {s['bare_med'] / rs['bare_med']:.2f}x | {s['engine_med'] / rs['engine_med']:.2f}x "
            f"| {res['prefill_tps'] / ref['prefill_tps']:.2f}x |",
        ]
    if "drift" in res:
        ag = res["agreement"]
        lines += [
            "",
            f"Batched vs alone (fp32 weights): greedy tokens identical for {ag['same']}/{ag['requests']} requests "
            f"({ag['tokens']} tokens each, all {ag['requests']} in one batch vs one at a time); max |log-prob "
            "difference| over 64 decode steps: "
            + ", ".join(f"{d:.1e} at B={b}" for b, d in res["drift"].items())
            + ".",
        ]
    b = res.get("backend") or {}
    lines += [
        "",
        f"Decode steps served from a step run ahead: {b.get('pipelined', 0)}; run-ahead steps undone: "
        f"{b.get('undone', 0)}.",
    ]
    return "\n".join(lines)


def write_report(path: Path, body: str) -> None:
    block = f"{BEGIN}\n{body}\n{END}"
    text = path.read_text() if path.exists() else f"# Engine benchmark\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
