"""Distil a small drafter for SmolLM2-135M-Instruct (shipped as ``smollm2-draft``).

    nice -n 10 python tools/train_drafter.py --target /work/models/smollm2-fp32 \
        --work /tmp/drafter --out engine/models/smollm2-draft --seed 0

Three stages, each skipped when its output already exists in ``--work``:

1. ``data``: what the drafter must predict is the target's greedy token given
   the committed context, so the labels are the target's own argmax:
   * chat answers the target generates greedily through Ember, batched
     (``--gen-prompts`` instructions built from templates × topics, none of
     them the benchmark's ``chat`` prompts), where the next token *is* the
     label;
   * local text (this Python's stdlib sources and the repo's docs), cut in
     ``--window``-token windows and labelled by one teacher-forced target
     forward per window (a prefill: ~20× cheaper per token than generating).
2. ``train``: a narrow llama (hidden ``--hidden``, ``--layers`` layers) with
   its own small head over the ``--head-vocab`` target ids the labels use
   most (``engine.speculation.draft_model.small_head_drafter``), whose embedding starts
   as the target's projected on its top principal directions, trained with
   cross-entropy on the target's argmax labels (hard distillation: the
   acceptance rule only ever asks whether the drafter's argmax equals the
   target's), for ``--steps`` or ``--train-minutes``, whichever ends first.
3. ``export``: the weights quantized to ``--bits`` (mlx-lm's affine
   quantization) into an mlx-lm directory without a tokenizer (the drafter
   borrows the target's; ``config.json`` records a digest of the target's
   vocabulary that ``engine.speculation.draft_model`` checks), with ``training_log.json``:
   the command, seed, hardware, wall time per stage and the held-out
   agreement with the target's greedy token per position (teacher-forced,
   on chat answers to held-out instructions and on held-out local text).

Everything is seeded (``--seed``); generation is greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

TOPICS = [
    "binary search",
    "hash tables",
    "recursion",
    "linked lists",
    "unit testing",
    "git branches",
    "HTTP status codes",
    "JSON parsing",
    "regular expressions",
    "SQL joins",
    "the CAP theorem",
    "garbage collection",
    "Python decorators",
    "list comprehensions",
    "async and await",
    "Docker images",
    "environment variables",
    "file permissions on Linux",
    "TCP handshakes",
    "caching",
    "rate limiting",
    "logging",
    "exceptions in Python",
    "type hints",
    "virtual environments",
    "big-O notation",
    "sorting",
    "photosynthesis",
    "the water cycle",
    "compound interest",
    "healthy sleep",
    "time management",
    "the French Revolution",
    "volcanoes",
    "black holes",
    "vaccines",
    "climate change",
    "the stock market",
    "writing a cover letter",
    "learning a language",
    "public speaking",
    "bread baking",
    "gardening",
    "electric cars",
    "solar panels",
    "the immune system",
    "machine learning",
    "neural networks",
    "prime numbers",
    "fractions",
    "probability",
    "the Pythagorean theorem",
    "matrices",
    "CSV files",
    "command-line arguments",
    "dictionaries in Python",
    "string formatting",
    "dates and times",
    "APIs",
]
TASKS = [
    "Explain {t} in simple terms.",
    "Give three practical tips about {t}.",
    "Write a short paragraph about {t} for a beginner.",
    "What are common mistakes people make with {t}?",
    "List the key facts about {t} as bullet points.",
    "Write a small Python example related to {t}, with comments.",
    "Summarize the history of {t} in a few sentences.",
    "How would you teach {t} to a ten-year-old?",
    "Write a short story that involves {t}.",
    "Compare two different approaches to {t}.",
    "What questions should I ask before starting with {t}?",
    "Describe a real-world example of {t}.",
    "Write a step-by-step guide to getting started with {t}.",
    "What are the pros and cons of {t}?",
    "Write an email to a colleague explaining {t}.",
    "Answer briefly: why does {t} matter?",
]
# More topics for a wider instruction set (the chat answers are most of the
# drafter's data: templates × topics, none of them the benchmark's prompts).
TOPICS += [
    "stacks and queues",
    "binary trees",
    "graph traversal",
    "dynamic programming",
    "memoization",
    "string manipulation in Python",
    "reading files in Python",
    "error handling",
    "code reviews",
    "writing documentation",
    "continuous integration",
    "database indexes",
    "password hashing",
    "encryption",
    "web servers",
    "HTML and CSS",
    "JavaScript promises",
    "object-oriented programming",
    "functional programming",
    "Python generators",
    "Python classes",
    "the Python standard library",
    "shell scripting",
    "memory leaks",
    "concurrency bugs",
    "profiling slow code",
    "version numbers",
    "open source licenses",
    "keyboard shortcuts",
    "spreadsheets",
    "the solar system",
    "the human heart",
    "earthquakes",
    "rainforests",
    "the Roman Empire",
    "the printing press",
    "the Industrial Revolution",
    "budgeting",
    "saving for retirement",
    "job interviews",
    "remote work",
    "meditation",
    "running a marathon",
    "cooking pasta",
    "making coffee",
    "recycling",
    "renewable energy",
    "electricity",
    "magnets",
    "gravity",
    "the speed of light",
    "DNA",
    "evolution",
    "bees",
    "the ocean tides",
    "chess openings",
    "writing poetry",
    "learning to draw",
    "photography",
    "music theory",
]


def gen_instructions(n: int, seed: int) -> list[str]:
    combos = [task.format(t=t) for t in TOPICS for task in TASKS]
    random.Random(seed).shuffle(combos)
    from bench.spec.workloads import CHAT_PROMPTS

    held = set(CHAT_PROMPTS)
    return [c for c in combos if c not in held][:n]


def local_texts() -> list[str]:
    """Text on this machine: the stdlib's sources (code with docstrings and
    comments, like the code an assistant writes) and the repo's docs (prose)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    from bench.spec.workloads import EDIT_FILES

    bench_files = {f for f, _, _ in EDIT_FILES}  # the edit/agent workloads' files stay held out
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size < 200_000 and p.name not in bench_files)
    repo_docs = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    out = []
    for p in files + repo_docs:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


# ---------------------------------------------------------------------------
# Stage 1: data.


async def _generate(
    target: str, jobs: list[tuple[Path, list[str]]], max_tokens: int, batch: int, minutes: float | None
) -> None:
    """Greedy chat answers, appended to each job's file (JSON lines) as they
    finish, so an interrupted run keeps what it made and resumes where it
    stopped. A wide batch: 32 rows share one pass over the weights.
    Nothing new starts after ``minutes``; rows already running finish."""
    from ember import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(model=target, max_batch=batch, prompt_cache_gib=0, max_queue=batch * 2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.time()
    async with Engine.open(cfg) as engine:
        sem = asyncio.Semaphore(batch)

        async def one(i: int, text: str, f: Any, done: set[int], path: Path, n: int) -> None:
            ids = engine.chat_prompt([{"role": "user", "content": text}])
            async with sem:
                if minutes and time.time() - t0 > minutes * 60:
                    return
                c = await engine.acomplete(ids, params)
            f.write(json.dumps({"i": i, "prompt": ids, "answer": c.token_ids}) + "\n")
            f.flush()
            done.add(i)
            if len(done) % 16 == 0:
                n_tok = sum(len(json.loads(ln)["answer"]) for ln in path.read_text().splitlines())
                print(
                    f"[data] {path.name}: {len(done)}/{n} answers, {n_tok} tokens, {time.time() - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )

        for path, prompts in jobs:
            done = {json.loads(ln)["i"] for ln in path.read_text().splitlines()} if path.exists() else set()
            with path.open("a") as f:
                todo = [one(i, p, f, done, path, len(prompts)) for i, p in enumerate(prompts) if i not in done]
                await asyncio.gather(*todo)


def label_windows(target: str, texts: list[str], window: int, max_windows: int, seed: int, batch: int = 8) -> dict:
    """Teacher-forced target argmax over ``window``-token windows of local text."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(target)
    rng = random.Random(seed)
    windows = []
    for t in texts:
        ids = tok.encode(t)
        for s in range(0, max(0, len(ids) - window), window):
            windows.append(ids[s : s + window])
    rng.shuffle(windows)
    windows = windows[:max_windows]
    labels = []
    t0 = time.time()
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i : i + batch])
        labels.extend(np.array(mx.argmax(model(x), axis=-1)).tolist())
        if i % (8 * batch) == 0:
            print(f"[data] labelled {i}/{len(windows)} windows ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    return {"inputs": windows, "labels": labels}


def stage_data(args: argparse.Namespace) -> None:
    gen_path, tf_path = args.work / "generated.jsonl", args.work / "teacher_forced.json"
    t0 = time.time()
    prompts = gen_instructions(args.gen_prompts, args.seed)
    from bench.spec.workloads import CHAT_PROMPTS

    # The benchmark's own chat prompts, answered by the target: an evaluation
    # set only (never trained on), the distribution ``bench.spec.sweep`` measures.
    jobs = [(args.work / "bench_chat.jsonl", CHAT_PROMPTS), (gen_path, prompts)]
    asyncio.run(_generate(str(args.target), jobs, args.gen_tokens, args.gen_batch, args.gen_minutes))
    log_s = args.work / "generated_seconds.json"
    spent = json.loads(log_s.read_text()) if log_s.exists() else 0.0
    log_s.write_text(json.dumps(spent + time.time() - t0))
    if not tf_path.exists():
        t0 = time.time()
        tf = label_windows(str(args.target), local_texts(), args.window, args.tf_windows, args.seed, args.tf_batch)
        tf["seconds"] = time.time() - t0
        tf_path.write_text(json.dumps(tf))


def examples(args: argparse.Namespace) -> tuple[list, list, list, list]:
    """(inputs, labels, mask) rows for training and held-out evaluation.
    Chat rows: prompt + answer, labels only on the answer (the next greedy token)."""
    rows = sorted(
        (json.loads(ln) for ln in (args.work / "generated.jsonl").read_text().splitlines()), key=lambda r: r["i"]
    )
    tf = json.loads((args.work / "teacher_forced.json").read_text())
    chat = []
    for r in rows:
        seq = r["prompt"] + r["answer"]
        x, y = seq[:-1], seq[1:]
        m = [0] * (len(r["prompt"]) - 1) + [1] * len(r["answer"])
        chat.append((x, y, m))
    local = [(x, y, [1] * len(x)) for x, y in zip(tf["inputs"], tf["labels"])]
    n_chat_eval = max(4, min(64, len(chat) // 8))
    n_local_eval = max(4, len(local) // 16)
    return chat[n_chat_eval:], local[n_local_eval:], chat[:n_chat_eval], local[:n_local_eval]


def bench_chat_rows(args: argparse.Namespace) -> list[tuple]:
    """The target's greedy answers to the benchmark's own chat prompts
    (``bench.spec.workloads.CHAT_PROMPTS``): evaluation only, never trained on."""
    path = args.work / "bench_chat.jsonl"
    if not path.exists():
        return []
    out = []
    for r in sorted((json.loads(ln) for ln in path.read_text().splitlines()), key=lambda r: r["i"]):
        seq = r["prompt"] + r["answer"]
        out.append((seq[:-1], seq[1:], [0] * (len(r["prompt"]) - 1) + [1] * len(r["answer"])))
    return out


# ---------------------------------------------------------------------------
# Stage 2: train.


def drafter_config(args: argparse.Namespace, target_cfg: dict, head_vocab: int) -> dict:
    from engine.speculation.draft_model import narrow_llama_config

    return {
        **narrow_llama_config(target_cfg, args.hidden, args.layers),
        "tie_word_embeddings": False,
        "ember_head_vocab": head_vocab,
    }


def pad_batch(rows: list[tuple], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.zeros((len(rows), length), np.int32)
    y = np.zeros((len(rows), length), np.int32)
    m = np.zeros((len(rows), length), np.float32)
    for i, (a, b, c) in enumerate(rows):
        n = min(length, len(a))
        x[i, :n], y[i, :n], m[i, :n] = a[-n:], b[-n:], c[-n:]
    return x, y, m


def agreement(model, rows: list[tuple], length: int) -> dict:
    """Teacher-forced: at each labelled position, does the drafter's argmax
    (mapped to the target's ids) equal the target's greedy token?"""
    import mlx.core as mx

    to_ids = getattr(model, "to_target_ids", lambda a: a)
    hit = tot = 0
    for i in range(0, len(rows), 8):
        x, y, m = pad_batch(rows[i : i + 8], length)
        pred = np.array(to_ids(mx.argmax(model(mx.array(x)), axis=-1)))
        hit += float(((pred == y) * m).sum())
        tot += float(m.sum())
    return {"agreement": round(hit / max(1.0, tot), 4), "positions": int(tot)}


def head_ids_for(rows: list[tuple], k: int) -> np.ndarray:
    """The ``k`` target tokens the labels use most (ties by id), as the head's vocabulary."""
    counts: dict[int, int] = {}
    for _, y, m in rows:
        for t, w in zip(y, m):
            if w:
                counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:k]
    return np.array(sorted(ranked), np.int32)


def stage_train(args: argparse.Namespace) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from engine.mlx.draft_model import small_head_drafter

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    target_cfg = json.loads((args.target / "config.json").read_text())
    chat, local, chat_eval, local_eval = examples(args)
    train = chat * args.chat_repeat + local
    ids = head_ids_for(train, args.head_vocab)
    cfg = drafter_config(args, target_cfg, len(ids))
    model = small_head_drafter(cfg)
    model.head_ids = mx.array(ids)
    full_to_small = np.full(target_cfg["vocab_size"], -1, np.int64)
    full_to_small[ids] = np.arange(len(ids))
    # Embedding from the target's, projected on its top principal directions:
    # the drafter starts knowing which tokens are alike.
    emb = np.array(mx.load(str(args.target / "model.safetensors"))["model.embed_tokens.weight"])
    centred = emb - emb.mean(0)
    _, _, vt = np.linalg.svd(centred[rng.choice(len(emb), 8192, replace=False)], full_matrices=False)
    proj = centred @ vt[: args.hidden].T
    proj *= 0.02 / proj.std()
    model.model.embed_tokens.weight = mx.array(proj.astype(np.float32))
    model.head.weight = mx.array((proj[ids] / 0.02 * 0.05).astype(np.float32))  # the same directions, to start
    model.freeze(keys=["head_ids"])
    if args.freeze_embedding:  # few labelled tokens: keep the target's token geometry, train the rest
        model.model.embed_tokens.freeze()
    mx.eval(model.parameters())
    covered = sum(int(full_to_small[t] >= 0) for _, y, m in local_eval + chat_eval for t, w in zip(y, m) if w)
    total = sum(int(w) for _, _, m in local_eval + chat_eval for w in m)
    print(
        f"[train] {len(chat)} chat rows ×{args.chat_repeat} + {len(local)} local windows; head {len(ids)} ids "
        f"cover {covered / max(1, total):.1%} of held-out labels; "
        f"params {sum(v.size for _, v in tree_flatten(model.trainable_parameters())) / 1e6:.2f}M",
        file=sys.stderr,
        flush=True,
    )

    def loss_fn(model, x, y, m):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="none")
        return (ce * m).sum() / mx.maximum(m.sum(), 1.0)

    warm = min(50, max(1, args.steps // 10))
    sched = optim.cosine_decay(args.lr, args.steps, end=args.lr * 0.05)
    opt = optim.AdamW(
        learning_rate=optim.join_schedules([optim.linear_schedule(1e-5, args.lr, warm), sched], [warm]),
        weight_decay=0.01,
    )
    step_fn = nn.value_and_grad(model, loss_fn)
    t0 = time.time()
    curve: list[tuple] = []
    evals: list[tuple] = []
    best = (-1.0, -1)
    step = 0
    for step in range(args.steps):
        if args.train_minutes and time.time() - t0 > args.train_minutes * 60:
            print(f"[train] time budget reached at step {step}", file=sys.stderr, flush=True)
            break
        idx = rng.integers(0, len(train), args.batch)
        x, y, m = pad_batch([train[i] for i in idx], args.window)
        small = full_to_small[y]
        m = m * (small >= 0)  # a label outside the head cannot be learnt: the drafter will miss it
        loss, grads = step_fn(model, mx.array(x), mx.array(np.maximum(small, 0).astype(np.int32)), mx.array(m))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if step % 25 == 0 or step == args.steps - 1:
            curve.append((step, round(float(loss), 4), round(time.time() - t0, 1)))
            print(f"[train] step {step} loss {float(loss):.3f} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            # Keep the weights that agree best on the held-out chat answers (the
            # benchmark's own prompts stay out of this choice: reported apart).
            a = agreement(model, chat_eval, 512)["agreement"]
            evals.append((step, a))
            print(f"[train] step {step} held-out chat agreement {a:.3f}", file=sys.stderr, flush=True)
            if a > best[0]:
                best = (a, step)
                model.save_weights(str(args.work / "drafter.safetensors"))
    final = agreement(model, chat_eval, 512)["agreement"] if args.eval_every else 1.0
    evals.append((step, final))
    if final >= best[0]:
        best = (final, step)
        model.save_weights(str(args.work / "drafter.safetensors"))
    (args.work / "drafter_config.json").write_text(json.dumps(cfg))
    return {
        "steps": step + 1,
        "seconds": round(time.time() - t0, 1),
        "loss_curve": curve,
        "train_rows": {"chat": len(chat), "local": len(local)},
        "head_covers_heldout_labels": round(covered / max(1, total), 4),
        "heldout_chat_agreement_by_step": evals,
        "kept_step": best[1],
    }


# ---------------------------------------------------------------------------
# Stage 3: export and measure.


def target_vocab_digest(target: Path) -> str:
    """The target tokenizer's vocabulary digest, as the engine computes it."""
    from transformers import AutoTokenizer

    from engine.speculation.draft_model import vocab_digest

    return vocab_digest(AutoTokenizer.from_pretrained(str(target)).get_vocab())


def stage_export(args: argparse.Namespace, train_log: dict) -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    from engine.mlx.draft_model import small_head_drafter

    cfg = json.loads((args.work / "drafter_config.json").read_text())
    model = small_head_drafter(cfg)
    model.load_weights(str(args.work / "drafter.safetensors"))
    _, _, chat_eval, local_eval = examples(args)
    bench_chat = bench_chat_rows(args)

    def measure(m) -> dict:
        return {
            "chat": agreement(m, chat_eval, 512),
            "local": agreement(m, local_eval, args.window),
            "bench_chat": agreement(m, bench_chat, 512),
        }

    measured = {"fp32": measure(model)}
    print(f"[export] fp32 agreement {measured['fp32']}", file=sys.stderr, flush=True)
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits)
        cfg["quantization"] = {"group_size": 64, "bits": args.bits}
        measured[f"q{args.bits}"] = measure(model)
    cfg["ember_vocab_sha256"] = target_vocab_digest(args.target)
    args.out.mkdir(parents=True, exist_ok=True)
    from mlx.utils import tree_flatten

    mx.save_safetensors(
        str(args.out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return measured


def stage_export_full(args: argparse.Namespace) -> dict:
    """The same drafter as an ordinary mlx-lm directory (full-vocabulary
    ``lm_head``, the target's tokenizer files), which ``mlx_lm.server
    --draft-model`` can load too: the body as trained, and a head over all
    49,152 ids fitted on the frozen body's features (its rows for the small
    head's ids start as the small head's), for ``--full-head-minutes``. For
    side-by-side benchmarks against mlx-lm (bench/spec/vs_mlx_lm.py); the
    small-head drafter is what ships (a full head at hidden 256 is ~12.6M
    multiply-adds per drafted token)."""
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from engine.mlx.draft_model import small_head_drafter

    t0 = time.time()
    cfg = json.loads((args.work / "drafter_config.json").read_text())
    small = small_head_drafter(cfg)
    small.load_weights(str(args.work / "drafter.safetensors"))
    chat, local, chat_eval, local_eval = examples(args)
    rng = np.random.default_rng(args.seed)
    # Features of the frozen body at labelled positions of the training rows.
    feats, labels = [], []
    order = rng.permutation(len(chat))
    for i in range(0, len(order), 8):
        x, y, m = pad_batch([chat[j] for j in order[i : i + 8]], args.window)
        h = np.array(small.model(mx.array(x)))
        keep = m > 0
        feats.append(h[keep])
        labels.append(y[keep])
        if sum(len(f) for f in feats) >= args.full_head_positions:
            break
    feats_a, labels_a = mx.array(np.concatenate(feats)), mx.array(np.concatenate(labels).astype(np.int32))
    full_cfg = {k: v for k, v in cfg.items() if k != "ember_head_vocab"}
    full_cfg["tie_word_embeddings"] = False
    model = llama.Model(llama.ModelArgs.from_dict(full_cfg))
    model.model = small.model
    # Rows outside the small head start pointing away from the mean feature
    # (logit about -10): the head starts as the small head's argmax, and the fit
    # only has to raise the rare ids the small head could not name.
    mu = np.concatenate(feats).mean(0)
    w = np.tile(-10.0 * mu / float(mu @ mu), (full_cfg["vocab_size"], 1)).astype(np.float32)
    w[np.array(small.head_ids)] = np.array(small.head.weight)
    head = nn.Linear(cfg["hidden_size"], full_cfg["vocab_size"], bias=False)
    head.weight = mx.array(w)

    def loss_fn(head, h, y):
        return nn.losses.cross_entropy(head(h), y, reduction="mean")

    opt = optim.Adam(learning_rate=1e-3)
    step_fn = nn.value_and_grad(head, loss_fn)
    steps = 0
    t_fit = time.time()
    while time.time() - t_fit < args.full_head_minutes * 60:
        idx = mx.array(rng.integers(0, feats_a.shape[0], 512))
        loss, grads = step_fn(head, feats_a[idx], labels_a[idx])
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        if steps % 50 == 0:
            print(f"[export-full] head step {steps} loss {float(loss):.3f}", file=sys.stderr, flush=True)
        steps += 1
    model.lm_head = head
    mx.eval(model.parameters())
    bench_chat = bench_chat_rows(args)
    measured = {"fp32": {"chat": agreement(model, chat_eval, 512), "bench_chat": agreement(model, bench_chat, 512)}}
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits)
        full_cfg["quantization"] = {"group_size": 64, "bits": args.bits}
        measured[f"q{args.bits}"] = {
            "chat": agreement(model, chat_eval, 512),
            "bench_chat": agreement(model, bench_chat, 512),
        }
    out = args.full_out
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(json.dumps(full_cfg, indent=1) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (args.target / name).exists():
            shutil.copy(args.target / name, out / name)
    log = {
        "head_fit_steps": steps,
        "head_fit_positions": int(feats_a.shape[0]),
        "seconds": round(time.time() - t0, 1),
        "heldout_agreement_with_target_greedy": measured,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"[export-full] {json.dumps(measured)}", file=sys.stderr, flush=True)
    return log


def main(argv: list[str] | None = None) -> None:
    from engine.mlx.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="smollm2-135m, gemma3-270m or an mlx-lm directory")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="data,train,export")
    ap.add_argument("--gen-prompts", type=int, default=160)
    ap.add_argument("--gen-tokens", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-minutes", type=float, default=None, help="start no new answer after this wall time")
    ap.add_argument("--tf-batch", type=int, default=8, help="windows per teacher-forced target forward")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--tf-windows", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--head-vocab", type=int, default=8192, help="the drafter's own head: this many target ids")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--chat-repeat", type=int, default=2, help="weight of the generated chat rows against local text")
    ap.add_argument("--train-minutes", type=float, default=25.0, help="stop training at this wall time")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between held-out checks (0: keep the last)")
    ap.add_argument("--freeze-embedding", action="store_true", help="keep the input embedding as initialised")
    ap.add_argument("--bits", type=int, default=4, help="quantize the shipped weights (0: keep fp32)")
    ap.add_argument("--full-out", type=Path, default=None, help="stage export-full: the mlx-lm directory to write")
    ap.add_argument("--full-head-minutes", type=float, default=4.0)
    ap.add_argument("--full-head-positions", type=int, default=60000)
    args = ap.parse_args(argv)
    from engine.models import resolve_model

    args.target = resolve_model(args.target)  # a name (smollm2-135m) or an mlx-lm directory
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    log_path = args.work / "log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log.update(
        {
            "command": "python tools/train_drafter.py " + " ".join(sys.argv[1:]),
            "seed": args.seed,
            "hardware": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.system()} (shared, nice {os.nice(0)})",
        }
    )
    if "data" in stages:
        t0 = time.time()
        stage_data(args)
        log.setdefault("data_seconds", round(time.time() - t0, 1))
    if "train" in stages:
        log["train"] = stage_train(args)
    if "export" in stages:
        log["heldout_agreement_with_target_greedy"] = stage_export(args, log.get("train", {}))
        rows = [json.loads(ln) for ln in (args.work / "generated.jsonl").read_text().splitlines()]
        tf = json.loads((args.work / "teacher_forced.json").read_text())
        log["data"] = {
            "generated_seconds": round(json.loads((args.work / "generated_seconds.json").read_text()), 1),
            "generated_rows": len(rows),
            "generated_tokens": sum(len(r["answer"]) for r in rows),
            "teacher_forced_seconds": round(tf["seconds"], 1),
            "teacher_forced_windows": len(tf["inputs"]),
        }
        (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if "export-full" in stages:
        if args.full_out is None:
            ap.error("--stages export-full needs --full-out")
        log["export_full"] = stage_export_full(args)
    log_path.write_text(json.dumps(log, indent=1))
    print(json.dumps(log.get("heldout_agreement_with_target_greedy"), indent=1))


if __name__ == "__main__":
    main()
