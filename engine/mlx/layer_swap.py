"""Hooking one model's layers by class: the C kernels' hooks
(``engine.mlx.qmm_linear``, ``engine.mlx.fmm_linear``) give a layer a subclass
whose call takes the kernel, in place (no copy of its weights), and give it back.
Only the model passed in changes, so an mlx-lm oracle model in the same process
stays mlx-lm's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def swap(model: Any, table: dict[type, type], accept: Callable[[Any], bool] = lambda m: True) -> int:
    """Each layer of ``model`` whose class is a key of ``table`` (and that
    ``accept``s) takes the class it maps to; returns how many layers now have
    one of the hooked classes (those hooked before included)."""
    hooked = set(table.values())
    done = 0
    for m in model.modules():
        cls = table.get(type(m))
        if cls is not None and accept(m):
            m.__class__ = cls
        done += type(m) in hooked
    return done


def unswap(model: Any, table: dict[type, type], forget: tuple[str, ...] = ()) -> int:
    """Undo ``swap`` with the same ``table``: each hooked layer gets its own
    class back and drops the attributes named in ``forget``; returns how many."""
    back = {v: k for k, v in table.items()}
    done = 0
    for m in model.modules():
        cls = back.get(type(m))
        if cls is not None:
            m.__class__ = cls
            for name in forget:
                m.__dict__.pop(name, None)
            done += 1
    return done
