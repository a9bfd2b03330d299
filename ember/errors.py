"""The errors an engine raises to its callers, in one place: what a server
maps to status codes (transport/wire/errors.py) without reaching into the actors.

``InboxFull`` is the actor runtime's: an actor's bounded inbox was full (the
engine is overloaded, like ``EngineOverloaded``).
"""

from actors.runtime import InboxFull
from engine.errors import EngineDead, EngineDraining, EngineError, EngineOverloaded, InvalidRequest, RequestFailed

__all__ = [
    "EngineDead",
    "EngineDraining",
    "EngineError",
    "EngineOverloaded",
    "InboxFull",
    "InvalidRequest",
    "RequestFailed",
]
