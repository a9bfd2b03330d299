"""Ember: an LLM inference engine on MLX built as asyncio actors.

The roof of the layers (docs/architecture.md): the public API and the one
place the engine is assembled. Transport, sims and benchmarks import from
here; below it are ``actors`` (the asyncio actors) and ``engine`` (the machine
parts: KV format, MLX and fake backends, speculation parts).

    from ember import Engine, EngineConfig, SamplingParams
"""

from ember.api import Completion, Engine
from engine.config import EngineConfig
from engine.errors import (
    EngineDead,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    RequestFailed,
)
from engine.fake.gpu import FakeGPUConfig
from engine.types import Delta, SamplingParams, Usage

__all__ = [
    "Completion",
    "Delta",
    "Engine",
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
