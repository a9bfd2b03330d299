"""Ember: an LLM inference engine on MLX built as asyncio actors.

The roof of the layers (docs/architecture.md): the public API (``ember.api``)
and the one place the engine is assembled (``ember.assemble``). Transport,
sims and benchmarks import from here, never from ``actors`` (the asyncio
actors) below it; ``engine`` (the machine parts: KV format, MLX and fake
backends, speculation parts) is the floor.

    from ember import Engine, EngineConfig, SamplingParams
"""

from ember.api import Completion, Engine, RequestStream
from ember.assemble import Parts, assemble, fake_backend, load_ports, preload_mlx, settings_from
from ember.errors import InboxFull
from engine.config import EngineConfig, FakeGPUConfig  # the fake GPU's settings, not its backend
from engine.errors import (
    EngineDead,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    InvalidRequest,
    RequestFailed,
)
from engine.ports import Ports
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
    "InboxFull",
    "InvalidRequest",
    "Parts",
    "Ports",
    "RequestFailed",
    "RequestStream",
    "SamplingParams",
    "Usage",
    "assemble",
    "fake_backend",
    "load_ports",
    "preload_mlx",
    "settings_from",
]
