"""LoRA adapters on the MLX backend, a different one per batch row (issue #43).

mlx-lm applies an adapter by swapping each adapted linear for its
``LoRALinear``: ``y = linear(x) + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)``
(``mlx_lm.tuner.lora``). Here every adapted linear becomes a ``LoRAStack``
holding the base linear and the (A, B, scale) of every adapter served that
adapts it, and the delta is added per batch row: ``rows`` (a context manager,
as ``engine.mlx.split_attention.parts``) says which adapter each row of the
forward being built runs with, and the stack adds adapter k's delta to the
rows of k only (masked; rows of the base model add nothing). A forward built
outside ``rows`` is the base model's: every backend path that runs one on
rows with adapters sets it (``engine.mlx.backend``, ``prefill``, ``run_ahead``).

The per-row delta is computed over the whole batch and masked, so a step
that mixes k adapters pays k low-rank products per adapted linear (rank r,
small next to the base matmul) rather than grouping rows by adapter.

Which linears an adapter adapts is read from its weights' names (as
``mlx_lm.tuner.utils.load_adapters`` loads exactly those): ``<module>.lora_a``
and ``<module>.lora_b``, the module a path in the model.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from engine.adapters import WEIGHTS, AdapterSpec, content_hash, read_config
from engine.mlx.cpu_layout import PretransposedLinear

__all__ = ["Adapters", "LoRAStack", "rows"]

_local = threading.local()


class _Delta:
    """One adapter's weights for one linear (a plain object: not a parameter of the model)."""

    __slots__ = ("a", "b", "scale")

    def __init__(self, a: mx.array, b: mx.array, scale: float):
        self.a, self.b, self.scale = a, b, scale


class _Deltas:
    """adapter index -> its ``_Delta`` (kept off ``nn.Module``'s parameter tree)."""

    def __init__(self) -> None:
        self.by_index: dict[int, _Delta] = {}


class LoRAStack(nn.Module):
    """A linear plus the LoRA deltas of every adapter that adapts it."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear
        self.deltas = _Deltas()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        for index, mask in getattr(_local, "rows", ()):
            d = self.deltas.by_index.get(index)
            if d is None:
                continue
            z = (x @ d.a) @ d.b
            delta = (d.scale * z).astype(x.dtype)  # as mlx_lm's LoRALinear
            y = y + (delta if mask is None else delta * mask)
        return y


@contextlib.contextmanager
def rows(adapters: list[int]) -> Iterator[None]:
    """Forwards built inside run row i with adapter ``adapters[i]`` (0: the base
    model). The per-row masks are made once here, for every stack's use."""
    before = getattr(_local, "rows", ())
    present = sorted(set(adapters) - {0})
    active: list[tuple[int, mx.array | None]] = []
    for k in present:
        if len(present) == 1 and all(a == k for a in adapters):
            active.append((k, None))  # every row: no mask, mlx-lm's own ops
        else:
            active.append((k, mx.array([1.0 if a == k else 0.0 for a in adapters])[:, None, None]))
    _local.rows = tuple(active)
    try:
        yield
    finally:
        _local.rows = before


def _dims(m: Any) -> tuple[int, int] | None:
    """(input, output) dims of a linear this module can wrap; None for another kind."""
    if isinstance(m, nn.QuantizedLinear):
        out, packed = m.weight.shape
        return packed * 32 // m.bits, out
    if isinstance(m, nn.Linear):
        out, inp = m.weight.shape
        return inp, out
    if isinstance(m, PretransposedLinear):
        inp, out = m["weight_t"].shape
        return inp, out
    return None


class Adapters:
    """The adapters served with one model: their ids (``NAME@HASH``) to row
    indexes (1, 2, …; 0 is the base model), their weights in ``LoRAStack``s."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.stacks = 0

    def load(self, model: nn.Module, spec: AdapterSpec) -> None:
        """Add ``spec``'s weights to ``model`` (wrapping the linears it adapts);
        ValueError names what does not fit. The files must still hash to the id
        the server started with: a replaced adapter needs a restart, else its
        KV would be cached under the old id."""
        path = pathlib.Path(spec.path)
        scale = float(read_config(path)["lora_parameters"]["scale"])
        weights = cast(dict[str, mx.array], mx.load(str(path / WEIGHTS)))  # a .safetensors: name -> array
        if f"{spec.name}@{content_hash(path)}" != spec.id:
            raise ValueError(f"adapter {spec.name!r} changed on disk since the server started: restart to serve it")
        pairs: dict[str, dict[str, mx.array]] = {}
        errors = []
        for name, w in weights.items():
            module, _, leaf = name.rpartition(".")
            if leaf not in ("lora_a", "lora_b"):
                errors.append(f"{name}: not a LoRA weight (lora_a, lora_b; DoRA's m is not served)")
            else:
                pairs.setdefault(module, {})[leaf] = w
        modules = dict(model.named_modules())
        index = len(self.index) + 1
        wrap: list[tuple[str, LoRAStack]] = []
        made: list[_Delta] = []
        for module, ab in sorted(pairs.items()):
            m = modules.get(module)
            base = m.linear if isinstance(m, LoRAStack) else m
            dims = _dims(base)
            if dims is None or base is None:
                errors.append(f"{module}: not a linear layer of this model ({type(m).__name__})")
                continue
            a, b = ab.get("lora_a"), ab.get("lora_b")
            if a is None or b is None:
                errors.append(f"{module}: needs both lora_a and lora_b")
                continue
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != dims[0] or b.shape[1] != dims[1] or a.shape[1] != b.shape[0]:
                errors.append(f"{module}: lora_a {a.shape} / lora_b {b.shape} do not fit a {dims[0]}->{dims[1]} linear")
                continue
            stack = m if isinstance(m, LoRAStack) else LoRAStack(base)
            stack.deltas.by_index[index] = delta = _Delta(a, b, scale)
            made.append(delta)
            if stack is not m:
                wrap.append((module, stack))
        if errors:
            raise ValueError(f"adapter {spec.name!r} ({path}) does not fit this model:\n  " + "\n  ".join(errors))
        if not pairs:
            raise ValueError(f"adapter {spec.name!r} ({path}) holds no LoRA weights")
        for module, stack in wrap:
            _replace(model, module, stack)
        self.stacks += len(wrap)
        mx.eval([(d.a, d.b) for d in made])
        self.index[spec.id] = index


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    """Set the module at dotted ``path`` (list items by index) to ``new``."""
    *parents, last = path.split(".")
    node: Any = model
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = new
    else:
        setattr(node, last, new)
