"""The strict request decoder every API's parser uses (OpenAI, Anthropic,
Responses): msgspec decodes the body into the route's request Struct, and any
problem becomes an ``InvalidRequest`` that names the offending field."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from engine.errors import InvalidRequest

_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_request(body: bytes, kind: type[Any]) -> Any:  # any request Struct (OpenAI, Anthropic, Responses)
    """Decode and check a request body; any problem is an ``InvalidRequest``."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _AT_PATH.search(message)
        param = (m.group(1) or None) if m else None
        unknown = _UNKNOWN.search(message)
        if unknown:  # name the field itself, not the object holding it
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        raise InvalidRequest(message, param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    return req.check()
