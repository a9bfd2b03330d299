"""Ember with speculation vs ``mlx_lm.server`` with the same draft model:
aggregate tokens/s of 4 concurrent ``chat`` requests (issue #21's last target, ≥ 2×).

    python -m bench.spec.vs_mlx_lm --model /work/models/smollm2-fp32 \\
        --draft-model /work/models/drafter-work4/full --rounds 5

Both servers run on 127.0.0.1 with the same target directory and the SAME
draft-model directory (an ordinary mlx-lm directory: a full-vocabulary head
and the target's tokenizer files, which is what ``mlx_lm.server
--draft-model`` can load; ``tools/train_drafter.py --stages export-full``
writes one). Servers are started and timed with ``bench.serve.vs_mlx_lm``'s helpers
(same BLAS, same client, same streaming completion call).

Each round sends the same ``concurrency`` chat prompts
(``bench.spec.workloads.CHAT_PROMPTS`` through the target's chat template,
applied here so both servers see identical text) to each server at once,
greedy, the same ``max_tokens``, alternating which server goes first. A
round's number is the completion tokens of all requests over the wall time
from sending the first to receiving the last. The report gives each server's
median, the ratio of medians and the median of the per-round (paired) ratios.

That both servers really speculate is checked, not assumed: Ember's ``/stats``
gives the tokens drafted and accepted during the rounds; ``mlx_lm.server``
reports nothing of its drafts, but it serves requests one at a time exactly
when a draft model is loaded (``is_batchable = draft_model is None`` in
mlx_lm.server), which shows as the last of the concurrent requests getting its
first token only after the others finished (its TTFT spread is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import bench.serve.vs_mlx_lm as vs
from bench.serve.vs_mlx_lm import Server, free_port, progress, stream_completion
from bench.spec.workloads import CHAT_PROMPTS

TARGET_RATIO = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.spec.vs_mlx_lm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target: smollm2-135m, gemma3-270m or an mlx-lm directory")
    ap.add_argument("--draft-model", required=True, help="an mlx-lm drafter directory both servers load")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--gamma", type=int, default=3, help="mlx_lm.server's --num-draft-tokens (its default: 3)")
    ap.add_argument(
        "--ember-gamma",
        default="same",
        help="Ember's --num-draft-tokens: 'same' (= --gamma), 'adaptive' (Ember's own policy), or a number",
    )
    ap.add_argument("--with-plain", action="store_true", help="also time Ember without a drafter (context)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.gamma < 1:
        ap.error("--rounds, --concurrency, --max-tokens and --gamma must be >= 1")
    if args.ember_gamma not in ("same", "adaptive"):
        try:
            if int(args.ember_gamma) < 1:
                raise ValueError
        except ValueError:
            ap.error(f"--ember-gamma must be 'same', 'adaptive' or a number >= 1, not {args.ember_gamma!r}")
    return args


def ember_gamma_flags(args: argparse.Namespace) -> list[str]:
    """Ember's γ flags: none when adaptive (its default), else --num-draft-tokens."""
    if args.ember_gamma == "adaptive":
        return []
    n = args.gamma if args.ember_gamma == "same" else int(args.ember_gamma)
    return ["--num-draft-tokens", str(n)]


def round_prompts(prompts: list[str], rnd: int, n: int) -> list[str]:
    """The ``n`` prompts of round ``rnd``: consecutive, wrapping, rotating by ``n`` a round."""
    return [prompts[(rnd * n + i) % len(prompts)] for i in range(n)]


def ratios(ember: list[float], mlx: list[float]) -> dict[str, float | None]:
    """Ratio of medians, and the median of per-round ratios (rounds paired by index)."""
    med_e = statistics.median(ember) if ember else None
    med_m = statistics.median(mlx) if mlx else None
    paired = [e / m for e, m in zip(ember, mlx) if m > 0]
    return {
        "ember": med_e,
        "mlx_lm": med_m,
        "ratio_of_medians": med_e / med_m if med_e is not None and med_m else None,
        "paired_median": statistics.median(paired) if paired else None,
        "paired_min": min(paired) if paired else None,
        "paired_max": max(paired) if paired else None,
    }


def chat_texts(model_dir: Path) -> list[str]:
    """CHAT_PROMPTS through the target's chat template, as text for /v1/completions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [
        str(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False))
        for p in CHAT_PROMPTS
    ]


async def aggregate(client: httpx.AsyncClient, srv: Server, prompts: list[str], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    samples = await asyncio.gather(*[stream_completion(client, srv.url, p, max_tokens) for p in prompts])
    wall = time.perf_counter() - t0
    tokens = sum(s.completion_tokens for s in samples)
    ttfts = sorted(s.ttft_s for s in samples)
    return {"tps": tokens / wall, "tokens": tokens, "wall_s": wall, "ttft_first_s": ttfts[0], "ttft_last_s": ttfts[-1]}


def spec_counters(srv: Server) -> dict[str, float]:
    """Ember's speculation counters (numbers only) from /stats; {} if it has none."""
    stats = httpx.get(srv.url + "/stats", timeout=30).json()
    found = next((v for v in _walk(stats) if isinstance(v, dict) and "drafter" in v), None)
    return {k: v for k, v in (found or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)}


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the rounds added to Ember's cumulative speculation counters (rates
    and gauges are left out: a difference of them means nothing), with the
    acceptance over those rounds."""
    keys = [k for k in after if k.startswith("spec_decode_") or k in ("plain_rounds", "fallbacks", "draft_faults")]
    out = {k: after[k] - before.get(k, 0) for k in keys}
    drafted = out.get("spec_decode_num_draft_tokens", 0)
    if drafted:
        out["acceptance"] = round(out.get("spec_decode_num_accepted_tokens", 0) / drafted, 4)
    return out


def _walk(obj):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)


async def run(args: argparse.Namespace) -> dict:
    from engine.models import resolve_model

    model_dir, draft_dir = resolve_model(args.model).resolve(), resolve_model(args.draft_model).resolve()
    vs.MODEL_NAME = str(model_dir)  # both servers serve the model under its directory's path
    prompts = chat_texts(model_dir)
    work = Path(tempfile.mkdtemp(prefix="ember-spec-vs-"))

    def ember_cmd(port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "transport.cli", "serve", "--model", str(model_dir), "--port", str(port), *extra]

    ember = Server(
        "ember",
        ember_cmd(p := free_port(), "--draft-model", str(draft_dir), *ember_gamma_flags(args)),
        p,
        work / "ember.log",
    )
    mlxlm = Server(
        "mlx-lm",
        [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            str(model_dir),
            "--draft-model",
            str(draft_dir),
            "--num-draft-tokens",
            str(args.gamma),
            "--port",
            str(p := free_port()),
        ],
        p,
        work / "mlx-lm.log",
    )
    plain = Server("ember-plain", ember_cmd(p := free_port()), p, work / "ember-plain.log")
    servers = [ember, mlxlm] + ([plain] if args.with_plain else [])
    rows: dict[str, list[dict]] = {s.name: [] for s in servers}
    res: dict = {"rows": rows, "load": []}
    try:
        for s in servers:
            progress(f"starting {s.name}")
            s.start()
        async with httpx.AsyncClient() as client:
            for s in servers:  # first-call compilation, allocator
                await aggregate(client, s, round_prompts(prompts, 0, 2), 16)
            before = spec_counters(ember)
            for rnd in range(args.rounds):
                res["load"].append(os.getloadavg()[0])
                order = servers if rnd % 2 == 0 else servers[::-1]
                batch = round_prompts(prompts, rnd, args.concurrency)
                for srv in order:
                    r = await aggregate(client, srv, batch, args.max_tokens)
                    rows[srv.name].append(r)
                    progress(
                        f"round {rnd + 1}/{args.rounds} {srv.name}: {r['tps']:.2f} tok/s "
                        f"({r['tokens']} tokens, {r['wall_s']:.1f}s, TTFT {r['ttft_first_s']:.1f}-{r['ttft_last_s']:.1f}s)"
                    )
            after = spec_counters(ember)
            res["ember_spec"] = counter_deltas(before, after)
    finally:
        res["load"].append(os.getloadavg()[0])
        for s in servers:
            s.stop()
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    res["summary"] = ratios([r["tps"] for r in rows["ember"]], [r["tps"] for r in rows["mlx-lm"]])
    if args.with_plain:
        res["plain"] = ratios([r["tps"] for r in rows["ember"]], [r["tps"] for r in rows["ember-plain"]])
    return res


def report(res: dict, args: argparse.Namespace) -> str:
    s = res["summary"]
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    med = lambda name, key: statistics.median(r[key] for r in res["rows"][name])  # noqa: E731
    lines = [
        f"Ember (speculating, --num-draft-tokens {ember_gamma_flags(args)[1] if ember_gamma_flags(args) else 'adaptive'})"
        f" vs mlx_lm.server (--num-draft-tokens {args.gamma}), the same target and draft model; "
        f"{args.concurrency} concurrent chat requests, greedy, max_tokens {args.max_tokens}, {args.rounds} rounds "
        f"(alternating order); load average {', '.join(f'{x:.1f}' for x in res['load'])}.",
        "",
        "| server | aggregate tok/s (median) | per round | TTFT of the first / last request (median s) |",
        "|---|---|---|---|",
    ]
    for name in res["rows"]:
        per = ", ".join(f"{r['tps']:.2f}" for r in res["rows"][name])
        lines.append(
            f"| {name} | {fmt(statistics.median(r['tps'] for r in res['rows'][name]))} | {per} | "
            f"{med(name, 'ttft_first_s'):.1f} / {med(name, 'ttft_last_s'):.1f} |"
        )
    verdict = "met" if (s["paired_median"] or 0) >= TARGET_RATIO else "NOT met"
    lines += [
        "",
        f"Ember / mlx-lm: ratio of medians **{fmt(s['ratio_of_medians'])}×**, paired median "
        f"**{fmt(s['paired_median'])}×** (range {fmt(s['paired_min'])}–{fmt(s['paired_max'])}); "
        f"target ≥ {TARGET_RATIO:g}×: {verdict}.",
    ]
    if "plain" in res:
        p = res["plain"]
        lines.append(
            f"Ember speculating / Ember without a drafter: paired median {fmt(p['paired_median'])}× "
            f"(ratio of medians {fmt(p['ratio_of_medians'])}×)."
        )
    spec = res.get("ember_spec") or {}
    if spec:
        lines.append(
            "Ember's speculation counters over the rounds: " + ", ".join(f"{k} {v:g}" for k, v in spec.items())
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    args = parse_args(argv)
    res = asyncio.run(run(args))
    text = report(res, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
