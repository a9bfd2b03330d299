"""Ember: an LLM inference engine on MLX built as asyncio actors."""

from engine.api import Completion, Engine
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
