"""Ember: an LLM inference engine on MLX built as asyncio actors."""

from engine.config import EngineConfig
from engine.errors import (
    EngineBusy,
    EngineDead,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    RequestFailed,
)
from engine.fake_gpu import FakeGPUConfig
from engine.types import Delta, SamplingParams, Usage

__all__ = [
    "Completion",
    "Delta",
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "EngineDead",
    "EngineDraining",
    "EngineError",
    "EngineOverloaded",
    "FakeGPUConfig",
    "InvalidRequest",
    "RequestFailed",
    "SamplingParams",
    "Usage",
]


def __getattr__(name: str):
    # Engine lives above the actors (which import engine.errors/types), so it is
    # imported lazily to keep `import engine.x` free of import cycles.
    if name in ("Engine", "Completion"):
        from engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
