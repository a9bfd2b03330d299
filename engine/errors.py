"""Errors a caller can see. A request's own failure ends its stream with one of
these; ``EngineDead`` means the whole engine is gone."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error Ember raises on purpose."""


class EngineDead(EngineError):
    """The engine stopped or crashed; no more work will be done."""


class EngineOverloaded(EngineError):
    """The admission queue is full: retry later (HTTP 429)."""

    retry_after_s = 1


class EngineDraining(EngineError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class InvalidRequest(EngineError):
    """The request itself is malformed (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailed(EngineError):
    """This one request failed inside the engine (the engine itself is fine)."""
