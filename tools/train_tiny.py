"""Train Ember's two bundled models: ``tiny`` (target) and ``tiny-draft``.

Both are mlx-lm ``llama`` models that share one byte-level BPE tokenizer.
The training text is the Python standard library source of the running
interpreter, which exists on every machine. Files are sorted by path and
every 25th file is held out for evaluation.

Usage (the shipped models were built with the command in docs/models.md)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
        python -m tools.train_tiny --out engine/models \\
        --minutes-target 24 --minutes-draft 4 --seed 0

    # smoke run, writes to a temp dir
    python -m tools.train_tiny --quick

Reproducibility. Everything is seeded (``mx.random.seed``, numpy generators).
``--minutes-*`` is turned into a fixed step count after the warmup steps
(the cosine schedule needs the total), so a time budget gives slightly
different step counts on different machines. The chosen counts are printed
and written to ``training_log.json`` in each model directory; pass them back
with ``--steps-target`` / ``--steps-draft`` to redo exactly the same run.
The corpus is whatever stdlib the interpreter has, so use the same Python
version (the shipped models used CPython 3.11) to get the same data.

On Linux ``python -m tools.train_tiny`` re-executes itself with the system
OpenBLAS preloaded, as ``ember`` does (``engine.mlx.blas``; ``EMBER_NO_OPENBLAS=1``
opts out): under MLX's reference BLAS a step-2 step took 11 s instead of 2.
"""

# Over 500 lines on purpose (issue 18): one self-contained training script (data,
# model, loss, schedule, evaluation, export) that nothing at runtime imports.

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML, with Hermes/Qwen2.5-style tool calls (`<tool_call>` JSON, tool results
# as `<tool_response>` in a user turn), which mlx-lm's `json_tools` parser reads.
# The models were never trained on chat: the template exists so the engine's chat
# and tool-calling endpoints work end to end (forced calls come from a grammar).
# The shipped copy is engine/models/tiny/chat_template.jinja; keep them equal.
# the bundled models live in the runtime package; this script only builds them
MODELS_DIR = Path(__file__).resolve().parents[1] / "engine" / "models"
CHAT_TEMPLATE = (MODELS_DIR / "tiny" / "chat_template.jinja").read_text()

HOLDOUT_EVERY = 25
VOCAB_SIZE = 2048
MAX_POSITIONS = 32768

TARGET_CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "intermediate_size": 704,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": MAX_POSITIONS,
    "vocab_size": VOCAB_SIZE,
}

DRAFT_CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 1,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": MAX_POSITIONS,
    "vocab_size": VOCAB_SIZE,
}

DEMO_PROMPTS = [
    "def ",
    "import os\n",
    "class Foo:\n    def __init__(self",
    "    def __repr__(self):\n",
    "for i in range(",
    "if __name__ == ",
    '"""',
    "    def read(self, n=-1):\n        ",
    "try:\n    import ",
    "        raise ValueError(",
]

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def log(*args):
    print(*args, flush=True)


# --------------------------------------------------------------------------
# corpus and tokenizer
# --------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_corpus(root: Path | None = None, max_files: int | None = None):
    """(train, heldout) lists of (relative path, text), deterministic.

    All ``*.py`` under the stdlib except site-packages and test directories,
    sorted by relative path; file i is held out when i % 25 == 0.
    """
    root = root or stdlib_dir()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append((rel.as_posix(), text))
    files.sort()
    if max_files is not None:
        files = files[:max_files]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    heldout = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    return train, heldout


def _transformers():
    """The ``train`` extra's transformers."""
    import transformers

    return transformers


def build_tokenizer(texts, vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on ``texts`` and save it HF-style in out_dir.

    Returns the ``transformers`` fast tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    PreTrainedTokenizerFast = _transformers().PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf


def encode_files(hf_tok, files) -> np.ndarray:
    """Concatenate the token ids of the files, EOS after each file."""
    eos = hf_tok.convert_tokens_to_ids(EOS_TOKEN)
    enc = hf_tok.backend_tokenizer.encode_batch([t for _, t in files])
    out = []
    for e in enc:
        out.extend(e.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int32)


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def make_model(config: dict):
    from mlx_lm.models.llama import Model, ModelArgs

    return Model(ModelArgs.from_dict(config))


def _value(a: Any) -> Any:
    """A 0-d mlx array's Python number (mlx's stubs type ``item()`` as int | float | complex)."""
    return a.item()


def count_params(model) -> int:
    from mlx.utils import tree_flatten

    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))  # a list without destination=
    return sum(v.size for _, v in params)


def save_model_dir(model, config: dict, tok_dir: Path, out_dir: Path, eos_id: int):
    from mlx_lm.utils import save_config, save_model

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()
    save_model(out_dir, model)
    # A single shard: the index is not needed by mlx_lm.load.
    idx = out_dir / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
    cfg = dict(config)
    cfg["eos_token_id"] = eos_id
    cfg["torch_dtype"] = "float32"
    save_config(cfg, out_dir / "config.json")
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out_dir / f.name)


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


def lr_at(step: int, total: int, warmup: int, peak: float, final_frac: float) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``peak * final_frac``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    lo = peak * final_frac
    return lo + 0.5 * (peak - lo) * (1.0 + math.cos(math.pi * t))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Evenly spaced, non-overlapping (seq_len + 1)-token windows."""
    n = (len(tokens) - 1) // seq_len
    idx = np.linspace(0, n - 1, num=min(n, max_windows)).astype(np.int64)
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in idx])


def top1_agreement(a, b, windows: np.ndarray, batch: int = 16) -> float:
    """Fraction of held-out positions where both models' argmax agree."""
    import mlx.core as mx

    hit, n = 0, 0
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i : i + batch, :-1])
        h = (mx.argmax(a(x), axis=-1) == mx.argmax(b(x), axis=-1)).sum()
        hit += _value(h)
        n += x.size
    return hit / n


def repeat_window(window: np.ndarray, rng, style: str = "jump") -> np.ndarray:
    """A window whose text repeats.

    ``jump``: at a random point p it jumps back to an earlier point s and goes
    on from there as the original did, until the window is full — a file that
    holds an earlier part of itself again, as code (and the grounded
    speculation benchmark) often does. ``cycle``: the window's first k tokens
    (k in [n/8, n/2]) repeated to its length. Both were tried (docs/models.md):
    each teaches copying and each made greedy output loop more."""
    n = len(window)
    if style == "cycle":
        k = int(rng.integers(max(2, n // 8), n // 2 + 1))
        return np.resize(window[:k], n)
    p = int(rng.integers(n // 4, (3 * n) // 4))
    s = int(rng.integers(0, p - n // 16))
    return np.concatenate([window[:p], window[s : s + n - p]])


def copy_windows(tokens: np.ndarray, excerpt: int, max_windows: int) -> np.ndarray:
    """Held-out excerpts given twice: (2 * excerpt + 1)-token windows."""
    wins = eval_windows(tokens, excerpt, max_windows)[:, :excerpt]
    return np.concatenate([wins, wins, wins[:, :1]], axis=1)


def copy_top1(model, windows: np.ndarray, batch: int = 16) -> float:
    """Teacher-forced top-1 accuracy over the second copy of each window."""
    import mlx.core as mx

    half = (windows.shape[1] - 1) // 2
    hit, n = 0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        x, y = w[:, :-1], w[:, 1:]
        pred = mx.argmax(model(x)[:, half:], axis=-1)
        h = (pred == y[:, half:]).sum()
        mx.eval(h)
        hit += _value(h)
        n += pred.size
    return hit / n


def loop_mask(cont: np.ndarray, n: int) -> np.ndarray:
    """1.0 on every token of an n-gram that already occurred earlier in the
    same row of ``cont`` (a model's own continuation): the tokens of a loop.
    Only the continuation counts, not its prefix, so continuing text the
    context holds (copying) is not penalised."""
    m = np.zeros(cont.shape, np.float32)
    for b, row in enumerate(cont.tolist()):
        seen: set[tuple[int, ...]] = set()
        for t in range(len(row) - n + 1):
            g = tuple(row[t : t + n])
            if g in seen:
                m[b, t : t + n] = 1.0
            seen.add(g)
    return m


def unlikelihood_loss(logits, targets, mask):
    """Sequence-level unlikelihood (Welleck et al., 2019, "Neural Text
    Generation with Unlikelihood Training"): -log(1 - p(token)) on the
    tokens ``mask`` marks, averaged over all of ``mask``'s positions."""
    import mlx.core as mx

    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(mx.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])
    return -(mx.log(mx.clip(1.0 - p, 1e-5, 1.0)) * mask).sum() / mask.size


def evaluate(model, windows: np.ndarray, batch: int = 16):
    """Mean next-token loss (nats) and teacher-forced top-1 accuracy."""
    import mlx.core as mx
    import mlx.nn as nn

    tot_loss, tot_hit, tot_n = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        x, y = w[:, :-1], w[:, 1:]
        logits = model(x)
        loss = nn.losses.cross_entropy(logits, y, reduction="sum")
        hit = (mx.argmax(logits, axis=-1) == y).sum()
        mx.eval(loss, hit)
        tot_loss += _value(loss)
        tot_hit += _value(hit)
        tot_n += y.size
    return tot_loss / tot_n, tot_hit / tot_n


def train_model(
    name: str,
    config: dict,
    train_tokens: np.ndarray,
    eval_wins: np.ndarray,
    *,
    seed: int,
    minutes: float | None,
    steps: int | None,
    batch: int,
    seq_len: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    eval_every: int,
    teacher=None,
    distill: float = 0.0,
    init=None,
    repeat_frac: float = 0.0,
    repeat_style: str = "jump",
    unlikelihood: float = 0.0,
    ul_ngram: int = 4,
    ul_prefix: int = 16,
    ul_tokens: int = 96,
):
    """Train one model; returns (model, record dict).

    ``init``: continue from this (loaded) model instead of a fresh one.
    ``repeat_frac``: that share of the batch rows is a corpus excerpt repeated
    until the window is full (see ``repeat_window``): it teaches the model to
    copy what its context already holds, which the corpus windows alone hardly
    do (a 128-token window of stdlib source rarely repeats a long span).

    With a ``teacher`` and ``distill`` = a > 0 the loss is (1 - a) * cross-entropy
    on the corpus + a * KL(teacher || model) on the teacher's next-token
    distributions: a drafter is only useful when it predicts what the target
    will say, and the target's distributions say more than the one corpus token.

    ``unlikelihood`` = u > 0 adds sequence-level unlikelihood against greedy
    loops: each step the model continues ``batch`` corpus prefixes of
    ``ul_prefix`` tokens greedily for ``ul_tokens`` tokens, and the loss gains
    u * -log(1 - p) on every token of an ``ul_ngram``-gram that its own
    continuation already produced (``loop_mask``). Cross-entropy on a corpus
    batch stays in the same step, so the model keeps the corpus while it
    unlearns its loops.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    if unlikelihood > 0.0 and teacher is not None and distill > 0.0:
        raise ValueError("unlikelihood and distillation do not combine: the step would drop the distillation term")
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model = make_model(config) if init is None else init
    mx.eval(model.parameters())
    n_params = count_params(model)
    log(f"[{name}] {n_params / 1e6:.2f}M params, config {json.dumps(config)}")

    optimizer = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=weight_decay)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    def distill_loss_fn(model, x, y, t_logp):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(t_logp) * (t_logp - logp)).sum(axis=-1).mean()
        return (1.0 - distill) * ce + distill * kl

    def ul_loss_fn(model, x, y, xs, ys, mask):
        ce = nn.losses.cross_entropy(model(x), y, reduction="mean")
        return ce + unlikelihood * unlikelihood_loss(model(xs), ys, mask)

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    ul_loss_and_grad = nn.value_and_grad(model, ul_loss_fn)
    distill_loss_and_grad = nn.value_and_grad(model, distill_loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, gnorm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss, gnorm

    @partial(mx.compile, inputs=state, outputs=state)
    def distill_step_fn(x, y, t_logp):
        loss, grads = distill_loss_and_grad(model, x, y, t_logp)
        grads, gnorm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss, gnorm

    @partial(mx.compile, inputs=state, outputs=state)
    def ul_step_fn(x, y, xs, ys, mask):
        loss, grads = ul_loss_and_grad(model, x, y, xs, ys, mask)
        grads, gnorm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss, gnorm

    def loop_batch():
        """The model's own greedy continuations and which of their tokens loop."""
        starts = rng.integers(0, len(train_tokens) - ul_prefix - 1, size=batch)
        pre = train_tokens[starts[:, None] + np.arange(ul_prefix)[None, :]]
        cont = greedy_batch(model, pre, ul_tokens)
        seq = mx.array(np.concatenate([pre, cont], axis=1))
        mask = np.zeros((batch, ul_prefix + ul_tokens - 1), np.float32)
        mask[:, ul_prefix - 1 :] = loop_mask(cont, ul_ngram)
        return seq[:, :-1], seq[:, 1:], mx.array(mask)

    def teacher_logp(x):
        if teacher is None or distill <= 0.0:
            return None
        t = mx.stop_gradient(teacher(x))
        return t - mx.logsumexp(t, axis=-1, keepdims=True)

    max_start = len(train_tokens) - seq_len - 1
    offs = np.arange(seq_len + 1)

    def get_batch():
        starts = rng.integers(0, max_start, size=batch)
        rows = train_tokens[starts[:, None] + offs[None, :]]
        if repeat_frac > 0.0:
            for i in np.flatnonzero(rng.random(batch) < repeat_frac):
                rows[i] = repeat_window(rows[i], rng, repeat_style)
        w = mx.array(rows)
        return w[:, :-1], w[:, 1:]

    l0, a0 = evaluate(model, eval_wins)
    curve = [{"step": 0, "time_s": 0.0, "eval_loss": l0, "eval_top1": a0}]
    log(f"[{name}] step 0 eval loss {l0:.3f} top1 {a0:.3f}")

    if steps is None and minutes is None:
        raise ValueError("give steps or minutes")
    total = steps if steps is not None else max(warmup + 1, 10**9)
    budget_s = minutes * 60.0 if minutes is not None else None
    train_time = 0.0  # excludes evaluation
    t_timed, n_timed = 0.0, 0  # step timing after the compile warmup
    smooth: float | None = None
    step = 0
    while step < total:
        optimizer.learning_rate = lr_at(step, total, warmup, lr, 0.1)
        x, y = get_batch()
        t0 = time.perf_counter()
        t_logp = teacher_logp(x)
        if unlikelihood > 0.0:
            loss, gnorm = ul_step_fn(x, y, *loop_batch())
        elif t_logp is None:
            loss, gnorm = step_fn(x, y)
        else:
            loss, gnorm = distill_step_fn(x, y, t_logp)
        mx.eval(loss, gnorm, model.parameters(), optimizer.state)
        dt = time.perf_counter() - t0
        train_time += dt
        if step >= 5:
            t_timed += dt
            n_timed += 1
        lv = loss.item()
        smooth = lv if smooth is None else 0.98 * smooth + 0.02 * lv
        step += 1
        if steps is None and step == warmup:
            # Fix the step count from the measured speed so that the cosine
            # schedule (which only starts now) ends at the time budget.
            per_step = t_timed / max(1, n_timed)
            # evaluation costs roughly 3% of the budget
            assert budget_s is not None  # without steps, the time budget sets them
            remaining = budget_s * 0.97 - train_time
            total = max(warmup + 1, warmup + int(remaining / per_step))
            log(f"[{name}] {per_step * 1000:.0f} ms/step -> total {total} steps")
        if step % 50 == 0 or step == total:
            log(
                f"[{name}] step {step}/{total} loss {lv:.3f} (ema {smooth:.3f}) "
                f"gnorm {float(gnorm):.2f} lr {float(optimizer.learning_rate):.2e} "
                f"{train_time:.0f}s"
            )
        if step % eval_every == 0 or step == total:
            el, ea = evaluate(model, eval_wins)
            curve.append(
                {
                    "step": step,
                    "time_s": round(train_time, 1),
                    "train_loss_ema": round(smooth, 4),
                    "eval_loss": el,
                    "eval_top1": ea,
                }
            )
            log(f"[{name}] step {step} eval loss {el:.3f} top1 {ea:.3f}")

    record = {
        "params": n_params,
        "steps": total,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_seen": total * batch * seq_len,
        "peak_lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "distill": distill if teacher is not None else 0.0,
        "repeat_frac": repeat_frac,
        "repeat_style": repeat_style if repeat_frac > 0 else None,
        "unlikelihood": {"weight": unlikelihood, "ngram": ul_ngram, "prefix": ul_prefix, "tokens": ul_tokens}
        if unlikelihood > 0
        else None,
        "init": "continued" if init is not None else "fresh",
        "train_time_s": round(train_time, 1),
        "ms_per_step": round(1000 * t_timed / max(1, n_timed), 1),
        "curve": curve,
    }
    return model, record


# --------------------------------------------------------------------------
# measurements on the saved models, through mlx-lm
# --------------------------------------------------------------------------


def greedy_batch(model, prefixes: np.ndarray, n: int) -> np.ndarray:
    """n greedy tokens (EOS ignored) for each row of ``prefixes`` (equal
    lengths), with an mlx-lm KV cache: ``(rows, n)``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prefixes), cache=cache)[:, -1, :], axis=-1)
    out = [y]
    for _ in range(n - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        out.append(y)
        mx.async_eval(y)
    return np.array(mx.stack(out, axis=1))


def greedy_tokens(model, prompt_ids, n: int):
    """n greedy tokens (EOS ignored) after one prompt."""
    return greedy_batch(model, np.array([prompt_ids]), n)[0].tolist()


def distinct_ngram_ratio(ids, n: int = 4) -> float:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def decode_step_ms(model, prompt_ids, warmup: int = 16, steps: int = 128) -> float:
    """Median wall ms of one batch-1 decode step (forward + argmax + eval)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1000.0 * float(np.median(times))


def measure(
    target_dir: Path, draft_dir: Path, heldout_wins: np.ndarray, heldout_tokens: np.ndarray | None = None
) -> dict:
    """Reload both models with mlx_lm.load and measure the acceptance numbers."""
    import mlx.core as mx
    from mlx_lm import generate, load

    mx.random.seed(0)
    target, tok = load(str(target_dir))
    draft, dtok = load(str(draft_dir))
    assert tok.vocab_size == dtok.vocab_size
    res: dict[str, Any] = {"demos": []}

    tl, ta = evaluate(target, heldout_wins)
    dl, da = evaluate(draft, heldout_wins)
    res["heldout"] = {
        "windows": int(len(heldout_wins)),
        "seq_len": int(heldout_wins.shape[1] - 1),
        "target_loss": tl,
        "target_top1": ta,
        "draft_loss": dl,
        "draft_top1": da,
        "draft_target_top1_agreement": top1_agreement(target, draft, heldout_wins),
    }
    if heldout_tokens is not None:
        # Can the model continue text its context already holds? (What prompt
        # lookup speculation bets on: a file that repeats.)
        for excerpt in (100, 200):
            cw = copy_windows(heldout_tokens, excerpt, 64)
            res["heldout"][f"target_copy{excerpt}_top1"] = copy_top1(target, cw)
            res["heldout"][f"draft_copy{excerpt}_top1"] = copy_top1(draft, cw)
        log(
            "copy top-1 (second copy of a held-out excerpt): "
            + ", ".join(f"{k} {v:.3f}" for k, v in res["heldout"].items() if "copy" in k)
        )
    log(f"held-out: target loss {tl:.3f} top1 {ta:.3f} | draft loss {dl:.3f} top1 {da:.3f}")

    for p in DEMO_PROMPTS:
        ids = tok.encode(p)
        out = greedy_tokens(target, ids, 128)
        dout = greedy_tokens(draft, ids, 128)
        d = {
            "prompt": p,
            "target_text": tok.decode(out),
            "target_distinct4": distinct_ngram_ratio(out, 4),
            "draft_text": tok.decode(dout),
            "draft_distinct4": distinct_ngram_ratio(dout, 4),
        }
        res["demos"].append(d)
        log(
            f"--- prompt {p!r}: target distinct-4 {d['target_distinct4']:.3f}, "
            f"draft distinct-4 {d['draft_distinct4']:.3f}"
        )
        log(p + d["target_text"])
    for who in ("target", "draft"):
        r = [d[f"{who}_distinct4"] for d in res["demos"]]
        res[f"mean_{who}_distinct4_first3"] = float(np.mean(r[:3]))
        res[f"mean_{who}_distinct4"] = float(np.mean(r))
    log(
        f"mean target distinct-4: first 3 prompts {res['mean_target_distinct4_first3']:.3f}, "
        f"all {len(r)} prompts {res['mean_target_distinct4']:.3f}"
    )

    ids = tok.encode("import os\n")
    # alternate, repeat, take the medians: the machine is shared and noisy
    tms, dms = [], []
    for _ in range(3):
        tms.append(decode_step_ms(target, ids))
        dms.append(decode_step_ms(draft, ids))
    res["target_step_ms"] = float(np.median(tms))
    res["draft_step_ms"] = float(np.median(dms))
    res["step_ratio"] = res["target_step_ms"] / res["draft_step_ms"]
    log(
        f"decode step: target {res['target_step_ms']:.2f} ms, draft "
        f"{res['draft_step_ms']:.2f} ms, ratio {res['step_ratio']:.2f}"
    )

    # plain mlx-lm entry points work on both
    for name, (m, t) in {"target": (target, tok), "draft": (draft, dtok)}.items():
        chat = t.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        text = generate(m, t, "def ", max_tokens=16)
        assert isinstance(text, str) and text, name
        assert chat, name
    text = generate(target, tok, "import os\n", max_tokens=16, draft_model=draft)
    assert text
    res["files_bytes"] = {str(d.name): (d / "model.safetensors").stat().st_size for d in (target_dir, draft_dir)}
    return res


# --------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="parent dir for tiny/ and tiny-draft/ (default: the package dir; a temp dir with --quick)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes-target", type=float, default=24.0)
    ap.add_argument("--minutes-draft", type=float, default=4.0)
    ap.add_argument("--steps-target", type=int, default=None, help="exact step count (overrides --minutes-target)")
    ap.add_argument("--steps-draft", type=int, default=None, help="exact step count (overrides --minutes-draft)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr-target", type=float, default=3e-3)
    ap.add_argument("--lr-draft", type=float, default=5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument(
        "--measure-only",
        action="store_true",
        help="only re-measure the models already in --out (no training); "
        "updates 'measurements' in their training_log.json",
    )
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (few files, few steps) into a temp dir")
    ap.add_argument(
        "--draft-only",
        action="store_true",
        help="keep the target (and tokenizer) already in --out/tiny; train only the drafter",
    )
    ap.add_argument(
        "--distill", type=float, default=0.0, help="drafter loss weight on KL(target || drafter), 0..1 (0: corpus only)"
    )
    ap.add_argument("--draft-layers", type=int, default=DRAFT_CONFIG["num_hidden_layers"])
    ap.add_argument(
        "--continue-target",
        action="store_true",
        help="keep training the target already in --out/tiny (same tokenizer) "
        "for --steps-target steps at --seq-len, then re-measure the pair",
    )
    ap.add_argument(
        "--repeat-frac",
        type=float,
        default=0.0,
        help="share of training windows that are an excerpt repeated to the "
        "window's length (teaches copying from the context)",
    )
    ap.add_argument(
        "--repeat-style",
        choices=("jump", "cycle"),
        default="jump",
        help="how a repeated window repeats (see repeat_window)",
    )
    ap.add_argument(
        "--unlikelihood",
        type=float,
        default=0.0,
        help="with --continue-target: weight of sequence-level unlikelihood on the "
        "tokens of n-grams the model's own greedy continuation repeats",
    )
    ap.add_argument("--ul-ngram", type=int, default=4, help="n of the repeated n-grams --unlikelihood penalises")
    ap.add_argument(
        "--eval-seq-len",
        type=int,
        default=None,
        help="held-out window length for the recorded measurements (default: --seq-len)",
    )
    args = ap.parse_args(argv)

    import mlx.core as mx

    t_start = time.time()
    np.random.seed(args.seed)
    mx.random.seed(args.seed)

    target_cfg = dict(TARGET_CONFIG, vocab_size=args.vocab_size)
    draft_cfg = dict(DRAFT_CONFIG, vocab_size=args.vocab_size, num_hidden_layers=args.draft_layers)
    max_files = None
    eval_n, heldout_n, eval_every = 64, 256, 250
    if args.quick:
        max_files = 150
        args.steps_target = args.steps_target or 30
        args.steps_draft = args.steps_draft or 20
        args.warmup = min(args.warmup, 10)
        eval_n, heldout_n, eval_every = 8, 16, 15
        target_cfg.update(num_hidden_layers=2, vocab_size=512)
        draft_cfg.update(vocab_size=512)

    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="ember-models-")) if args.quick else MODELS_DIR
    out = args.out
    log(f"python {sys.version.split()[0]}, stdlib {stdlib_dir()}, out {out}")

    train_files, heldout_files = collect_corpus(max_files=max_files)
    if args.measure_only:
        AutoTokenizer = _transformers().AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(out / "tiny"))
        heldout_tokens = encode_files(hf, heldout_files)
        heldout_wins = eval_windows(heldout_tokens, args.eval_seq_len or args.seq_len, heldout_n)
        res = measure(out / "tiny", out / "tiny-draft", heldout_wins, heldout_tokens)
        for sub in ("tiny", "tiny-draft"):
            update_measurements(out / sub / "training_log.json", res)
        print(json.dumps({k: v for k, v in res.items() if k != "demos"}, indent=1))
        return res
    log(
        f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files, "
        f"{sum(len(t) for _, t in train_files) / 1e6:.1f}M train chars"
    )
    if args.continue_target:
        return continue_target(
            args,
            target_cfg,
            train_files,
            heldout_files,
            t_start,
            eval_n=eval_n,
            heldout_n=heldout_n,
            eval_every=eval_every,
            argv=argv,
        )
    if args.draft_only:
        return train_draft_only(
            args,
            draft_cfg,
            train_files,
            heldout_files,
            t_start,
            eval_n=eval_n,
            heldout_n=heldout_n,
            eval_every=eval_every,
            argv=argv,
        )

    t0 = time.time()
    with tempfile.TemporaryDirectory() as td:
        tok_dir = Path(td) / "tok"
        hf = build_tokenizer([t for _, t in train_files], target_cfg["vocab_size"], tok_dir)
        eos_id = hf.convert_tokens_to_ids(EOS_TOKEN)
        train_tokens = encode_files(hf, train_files)
        heldout_tokens = encode_files(hf, heldout_files)
        log(
            f"tokenizer + encode {time.time() - t0:.1f}s: {len(train_tokens) / 1e6:.2f}M train "
            f"tokens, {len(heldout_tokens) / 1e6:.3f}M held-out tokens "
            f"({sum(len(t) for _, t in train_files) / len(train_tokens):.2f} chars/token)"
        )

        eval_wins = eval_windows(heldout_tokens, args.seq_len, eval_n)
        heldout_wins = eval_windows(heldout_tokens, args.seq_len, heldout_n)

        common = dict(
            batch=args.batch, seq_len=args.seq_len, warmup=args.warmup, weight_decay=0.1, eval_every=eval_every
        )
        target, trec = train_model(
            "target",
            target_cfg,
            train_tokens,
            eval_wins,
            seed=args.seed,
            minutes=args.minutes_target,
            steps=args.steps_target,
            lr=args.lr_target,
            **common,
        )
        save_model_dir(target, target_cfg, tok_dir, out / "tiny", eos_id)
        del target
        teacher = None
        if args.distill > 0:
            from mlx_lm import load

            teacher, _ = load(str(out / "tiny"))
        draft, drec = train_model(
            "draft",
            draft_cfg,
            train_tokens,
            eval_wins,
            seed=args.seed + 1,
            minutes=args.minutes_draft,
            steps=args.steps_draft,
            lr=args.lr_draft,
            teacher=teacher,
            distill=args.distill,
            **common,
        )
        save_model_dir(draft, draft_cfg, tok_dir, out / "tiny-draft", eos_id)
        del draft

    train_wall = time.time() - t_start
    res = measure(out / "tiny", out / "tiny-draft", heldout_wins, heldout_tokens)
    total_wall = time.time() - t_start
    meta = run_meta(
        args,
        argv,
        train_files,
        heldout_files,
        train_tokens,
        heldout_tokens,
        res,
        wall_s_until_saved=round(train_wall, 1),
        wall_s_total=round(total_wall, 1),
    )
    for sub, rec in (("tiny", trec), ("tiny-draft", drec)):
        (out / sub / "training_log.json").write_text(json.dumps(dict(meta, training=rec), indent=1) + "\n")
    log(f"done in {total_wall:.0f}s ({train_wall:.0f}s until both were saved); out {out}")
    return meta


def run_meta(args, argv, train_files, heldout_files, train_tokens, heldout_tokens, res, **walls) -> dict:
    """The run's settings and measurements, as ``training_log.json`` keeps them."""
    import mlx.core as mx

    return {
        "command": "python -m tools.train_tiny " + " ".join(sys.argv[1:] if argv is None else argv),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # set at runtime, absent from mlx's stubs
        "seed": args.seed,
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
        "train_tokens": int(len(train_tokens)),
        "heldout_tokens": int(len(heldout_tokens)),
        **walls,
        "measurements": res,
    }


def shipped_tokenizer_data(args, train_files, heldout_files, eval_n: int, heldout_n: int):
    """The corpus encoded with the tokenizer already in ``--out/tiny`` (a run
    that keeps the shipped tokenizer): ``(eos_id, train_tokens,
    heldout_tokens, eval_windows, heldout_windows)``."""
    AutoTokenizer = _transformers().AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(args.out / "tiny"))
    train_tokens = encode_files(hf, train_files)
    heldout_tokens = encode_files(hf, heldout_files)
    return (
        hf.convert_tokens_to_ids(EOS_TOKEN),
        train_tokens,
        heldout_tokens,
        eval_windows(heldout_tokens, args.seq_len, eval_n),
        eval_windows(heldout_tokens, args.eval_seq_len or args.seq_len, heldout_n),
    )


def save_keeping_tokenizer(model, config: dict, out: Path, sub: str, eos_id: int) -> None:
    """Save ``model`` as ``out/sub`` with the tokenizer files of ``out/tiny``
    (copied aside first: ``sub`` may be ``tiny`` itself)."""
    with tempfile.TemporaryDirectory() as td:
        tok_dir = Path(td)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (out / "tiny" / name).exists():
                shutil.copy2(out / "tiny" / name, tok_dir / name)
        save_model_dir(model, config, tok_dir, out / sub, eos_id)


def train_draft_only(args, draft_cfg, train_files, heldout_files, t_start, *, eval_n, heldout_n, eval_every, argv):
    """Retrain only ``tiny-draft`` against the target already in ``--out/tiny``,
    with that directory's tokenizer (so the pair keeps sharing it)."""
    from mlx_lm import load

    out = args.out
    eos_id, train_tokens, heldout_tokens, eval_wins, heldout_wins = shipped_tokenizer_data(
        args, train_files, heldout_files, eval_n, heldout_n
    )
    teacher = load(str(out / "tiny"))[0] if args.distill > 0 else None
    draft, drec = train_model(
        "draft",
        draft_cfg,
        train_tokens,
        eval_wins,
        seed=args.seed + 1,
        minutes=args.minutes_draft,
        steps=args.steps_draft,
        lr=args.lr_draft,
        batch=args.batch,
        seq_len=args.seq_len,
        warmup=args.warmup,
        weight_decay=0.1,
        eval_every=eval_every,
        teacher=teacher,
        distill=args.distill,
    )
    save_keeping_tokenizer(draft, draft_cfg, out, "tiny-draft", eos_id)
    del draft, teacher
    res = measure(out / "tiny", out / "tiny-draft", heldout_wins, heldout_tokens)
    meta = run_meta(
        args,
        argv,
        train_files,
        heldout_files,
        train_tokens,
        heldout_tokens,
        res,
        wall_s_total=round(time.time() - t_start, 1),
    )
    (out / "tiny-draft" / "training_log.json").write_text(json.dumps(dict(meta, training=drec), indent=1) + "\n")
    update_measurements(out / "tiny" / "training_log.json", res)
    log(f"drafter done in {time.time() - t_start:.0f}s; out {out}")
    return meta


def update_measurements(log_file: Path, res: dict) -> None:
    """The pair was re-measured: a model's training log carries the new numbers."""
    if log_file.exists():
        meta = json.loads(log_file.read_text())
        meta["measurements"] = res
        log_file.write_text(json.dumps(meta, indent=1) + "\n")


def continue_target(args, target_cfg, train_files, heldout_files, t_start, *, eval_n, heldout_n, eval_every, argv):
    """Keep training the target in ``--out/tiny`` (a second stage: longer
    windows, some of them repeated excerpts), save it in place with its
    tokenizer, and re-measure the pair. The drafter is left as it is."""
    from mlx_lm import load

    out = args.out
    eos_id, train_tokens, heldout_tokens, eval_wins, heldout_wins = shipped_tokenizer_data(
        args, train_files, heldout_files, eval_n, heldout_n
    )
    init, _ = load(str(out / "tiny"))
    target, trec = train_model(
        "target",
        target_cfg,
        train_tokens,
        eval_wins,
        seed=args.seed + 2,
        minutes=None if args.steps_target else args.minutes_target,
        steps=args.steps_target,
        lr=args.lr_target,
        batch=args.batch,
        seq_len=args.seq_len,
        warmup=args.warmup,
        weight_decay=0.1,
        eval_every=eval_every,
        init=init,
        repeat_frac=args.repeat_frac,
        repeat_style=args.repeat_style,
        unlikelihood=args.unlikelihood,
        ul_ngram=args.ul_ngram,
    )
    save_keeping_tokenizer(target, target_cfg, out, "tiny", eos_id)
    del target, init
    res = measure(out / "tiny", out / "tiny-draft", heldout_wins, heldout_tokens)
    meta = run_meta(
        args,
        argv,
        train_files,
        heldout_files,
        train_tokens,
        heldout_tokens,
        res,
        wall_s_total=round(time.time() - t_start, 1),
    )
    f = out / "tiny" / "training_log.json"
    before = json.loads(f.read_text()) if f.exists() else {}
    # Earlier stages' records stay: this model is those runs plus this one.
    prior = {k: v for k, v in before.items() if k not in ("measurements", "stages")}
    stages = list(before.get("stages") or []) + ([prior] if prior else [])
    f.write_text(json.dumps(dict(meta, training=trec, stages=stages), indent=1) + "\n")
    update_measurements(out / "tiny-draft" / "training_log.json", res)
    log(f"target continued in {time.time() - t_start:.0f}s; out {out}")
    return meta


if __name__ == "__main__":
    from engine.mlx.blas import maybe_reexec_with_openblas

    # Like `ember` and the sims: under MLX's reference BLAS a step is ~5x slower.
    maybe_reexec_with_openblas()
    main()
