"""Where a turn of ``bench.agent_session`` parted from the reference: the next-token logits there.

    python -m bench.near_tie --session /tmp/as.json --model qwen2.5-coder-1.5b --turn 4

Ember serves the 1.5B in q8 and mlx_lm.server the float32 conversion, so a
reply may part from the reference's where the two weights rank the next token
differently. This rebuilds the turn's prompt from the session's JSON (the
reference's own earlier replies, as its history held them), feeds it and the
replies' common prefix (cut at its last space: the next token carries its
leading space) through the float32 model (mlx-lm) and Ember's load of the
served weights (one forward each, the 8-bit prefill on the dot path and on
dequantize + GEMM), and prints the top three tokens and the margin of the
first over the second. A margin of hundredths of a logit is a near tie that
the weights' rounding decides; a wide one would be a fault.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def turn_prompt(rows: list[dict[str, Any]], turn: int, n_turns: int) -> tuple[list[dict[str, str]], str, str]:
    """The reference's messages up to ``turn``'s user message, and the two replies of that turn."""
    from bench.agent_session import SYSTEM, user_turns
    from bench.agent_session_report import REFERENCE, SUBJECT

    ref = {r["turn"]: r["reply"] for r in rows if r["server"] == REFERENCE}
    mine = {r["turn"]: r["reply"] for r in rows if r["server"] == SUBJECT}
    texts = user_turns(n_turns)
    history = [{"role": "system", "content": SYSTEM}]
    for k in range(1, turn):
        history += [{"role": "user", "content": texts[k - 1]}, {"role": "assistant", "content": ref[k]}]
    history.append({"role": "user", "content": texts[turn - 1]})
    return history, mine[turn], ref[turn]


def common_prefix(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i].rstrip(" ")


def top_tokens(model: Any, tok: Any, history: list[dict[str, str]], prefix: str, k: int = 3) -> list[tuple[str, float]]:
    import mlx.core as mx
    import numpy as np

    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False) + prefix
    logits = model(mx.array([tok.encode(text, add_special_tokens=False)]))[0, -1].astype(mx.float32)
    top = [int(t) for t in np.asarray(mx.argsort(-logits)[:k])]
    return [(tok.decode([t]), float(logits[t].item())) for t in top]


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(prog="python -m bench.near_tie", description=__doc__.split("\n\n")[0])
    ap.add_argument("--session", required=True, help="the JSON bench.agent_session wrote (--json)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--turn", type=int, help="default: the first turn whose replies differ")
    ap.add_argument("--turns", type=int, default=6, help="the session's --turns")
    args = ap.parse_args(argv)
    with open(args.session) as f:
        rows = json.load(f)
    from bench.agent_session_report import REFERENCE, SUBJECT

    turn = args.turn or next(
        r["turn"]
        for r in rows
        if r["server"] == SUBJECT
        and r["reply"] != next(x["reply"] for x in rows if x["server"] == REFERENCE and x["turn"] == r["turn"])
    )
    history, mine, ref = turn_prompt(rows, turn, args.turns)
    prefix = common_prefix(mine, ref)
    print(
        f"turn {turn} parted after {prefix[-60:]!r}: ember {mine[len(prefix) :][:30]!r}, reference {ref[len(prefix) :][:30]!r}"
    )

    from mlx_lm import load

    from bench.serve.vs_mlx_lm import model_dir_in
    from engine.config import EngineConfig
    from engine.mlx import qmm_linear
    from engine.mlx.loading import read_model
    from engine.models import resolve_model

    def show(name: str, top: list[tuple[str, float]]) -> None:
        cells = ", ".join(f"{t!r} {v:.3f}" for t, v in top)
        print(f"| {name} | {cells} | {top[0][1] - top[1][1]:.3f} |", flush=True)

    print("\n| weights | top 3 next tokens (logit) | margin |\n|---|---|---|")
    model, tok = load(str(model_dir_in(args.model, "float32")))
    show("float32 (mlx-lm, the reference's)", top_tokens(model, tok, history, prefix))
    del model
    loaded = read_model(resolve_model(args.model), EngineConfig(model=args.model))
    measured = qmm_linear.dot_rows()
    for rows_ in dict.fromkeys([0, measured]):
        qmm_linear.set_dot_rows(rows_)
        label = "served (Ember's load), 8-bit prefill " + (f"GEMM from {rows_} rows" if rows_ else "on the dot path")
        show(label, top_tokens(loaded.model, loaded.tokenizer, history, prefix))


if __name__ == "__main__":
    main()
