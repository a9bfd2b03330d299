"""Ember's bundled models.

``tiny`` is a small llama target and ``tiny-draft`` a 1-layer drafter for it.
Both share one tokenizer and are trained by ``python -m tools.train_tiny``
(see docs/models.md). They ship as package data in mlx-lm's standard layout,
so ``mlx_lm.load(resolve_model("tiny"))`` works.
"""

from __future__ import annotations

import pathlib

_HERE = pathlib.Path(__file__).resolve().parent

BUNDLED: dict[str, pathlib.Path] = {
    "tiny": _HERE / "tiny",
    "tiny-draft": _HERE / "tiny-draft",
}

# Drafters for targets that are not bundled: no tokenizer of their own (they
# name the target's by digest, engine.speculation.draft_model.vocab_digest), so
# ``mlx_lm.load`` alone cannot open them; the engine's drafter can.
DRAFTERS: dict[str, pathlib.Path] = {
    "smollm2-draft": _HERE / "smollm2-draft",  # for SmolLM2-135M-Instruct (tools/train_drafter.py)
}


def resolve_model(name_or_path: str | pathlib.Path, *, pull: bool = True, draft: bool = False) -> pathlib.Path:
    """Map a bundled model name to its directory; anything else is a path.

    A short name of a packaged real model (``smollm2-135m``, ``gemma3-270m``:
    ``engine.mlx.gguf_models``) or a ``.gguf`` file resolves to its converted
    mlx-lm directory, converting it on first use (``engine.mlx.gguf_convert``).
    A hub name (``ORG/NAME[@REVISION][:QUANT]``) that is not a local path is
    found in the hub cache or LM Studio's folder, else downloaded
    (``engine.models.hub``; ``hub.HubError`` when it cannot be had, or when it
    is not here and ``pull`` is False). ``draft``: the model as a drafter, in
    its packaged ``draft_weights`` format where it has one.
    Raises FileNotFoundError when the resulting directory does not exist.
    """
    key = str(name_or_path)
    from engine.mlx.gguf_models import PACKAGED

    if key in PACKAGED or (key.endswith(".gguf") and pathlib.Path(key).expanduser().is_file()):
        from engine.mlx.gguf_convert import cached_conversion, default_dtype
        from engine.mlx.gguf_models import packaged_gguf

        if key in PACKAGED:
            packaged = PACKAGED[key]
            weights = (draft and packaged.draft_weights) or packaged.cpu_weights
            return cached_conversion(packaged_gguf(key), default_dtype(weights))
        return cached_conversion(key)
    if key in BUNDLED or key in DRAFTERS:
        path = BUNDLED.get(key) or DRAFTERS[key]
        if not path.is_dir():
            raise FileNotFoundError(
                f"bundled model {key!r} is missing at {path}; rebuild it with "
                "`python -m tools.train_tiny` (see docs/models.md)"
            )
        return path
    path = pathlib.Path(name_or_path).expanduser()
    if not path.exists():
        from engine.models import hub

        ref = hub.parse(key)
        if ref is not None:
            return hub.resolve(ref, pull=pull)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {key!r} is neither a bundled model ({', '.join(sorted(BUNDLED))}), "
            f"a packaged one ({', '.join(sorted(PACKAGED))}), a .gguf file, an existing directory "
            "nor a Hugging Face name (ORG/NAME)"
        )
    return path


__all__ = ["BUNDLED", "DRAFTERS", "resolve_model"]
