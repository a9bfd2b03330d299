"""``POST /v1/embeddings`` in OpenAI's shape, over an embedding model in the registry.

    {"model": "all-minilm-l6-v2", "input": "hello" | ["a", "b"] | [1, 2, 3] | [[1, 2], [3]],
     "encoding_format": "float" | "base64", "dimensions": 128, "user": "..."}

Strings are tokenized with the model's tokenizer (its truncation at the
model's limit); token arrays are checked against the vocabulary and cut at the
same limit. ``base64`` is the little-endian float32 bytes of each vector (what
the openai SDK decodes). ``dimensions`` keeps the first N components,
renormalised, and only for a model that says it was trained for that
(Matryoshka; ``truncatable``): a 400 naming the parameter otherwise.
``user`` is accepted and counted (``/stats`` envelope), not used.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from transport.wire.errors import ApiError
from transport.wire.request_io import read_body

MAX_INPUTS = 2048  # OpenAI's own cap on the inputs of one request


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: str | list[str | int | list[int]]  # one kind per request, checked in _inputs
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _decode(body: bytes) -> EmbeddingsRequest:
    try:
        return msgspec.json.decode(body, type=EmbeddingsRequest)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = msg.rsplit("at `$.", 1)[-1].split("`")[0].split("[")[0] if "at `$." in msg else None
        raise ApiError(400, f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def _inputs(req: EmbeddingsRequest) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token arrays)."""
    x: Any = req.input
    if isinstance(x, str):
        return [x], None
    if not x:
        raise ApiError(400, "input must not be empty", param="input")
    if len(x) > MAX_INPUTS:
        raise ApiError(400, f"input has {len(x)} items; at most {MAX_INPUTS}", param="input")
    kinds = {type(a) for a in x}
    if len(kinds) > 1:
        raise ApiError(400, "input mixes strings, token ids and token arrays; use one kind", param="input")
    if isinstance(x[0], str):
        return list(x), None
    if isinstance(x[0], int):
        return None, [list(x)]
    if any(not a for a in x):
        raise ApiError(400, "input has an empty token array", param="input")
    return None, [list(a) for a in x]


async def embeddings(request: Request, host: Any) -> Response:
    host.require_ready()
    req = _decode(await read_body(request, host.max_body_bytes))
    if req.encoding_format not in ("float", "base64"):
        raise ApiError(
            400, f"encoding_format must be 'float' or 'base64', not {req.encoding_format!r}", param="encoding_format"
        )
    if req.user is not None:
        host.envelope.note("embeddings", "user", "accepted")
    texts, arrays = _inputs(req)
    engine, model = await host.engine_for(req.model, kind="embed")
    if req.dimensions is not None:
        if not engine.truncatable:
            raise ApiError(
                400,
                f"the model {model!r} does not support dimensions (it was not trained for truncated embeddings; "
                f"its vectors have {engine.dim})",
                param="dimensions",
            )
        if not 1 <= req.dimensions <= engine.dim:
            raise ApiError(400, f"dimensions must be between 1 and {engine.dim}", param="dimensions")
    if texts is not None:
        # no byte bound: the tokenizer truncates each text at the model's limit, the body cap bounds the rest
        ids = await host.off_loop(engine.tokenize_many, texts, engine=_Inline(False))
    else:
        assert arrays is not None
        ids = [engine.check_tokens(a, "input") for a in arrays]
    from ember.embed import truncate_dims

    vecs = truncate_dims(await engine.aembed(ids), req.dimensions, engine.encoder.normalize)
    n = sum(len(i) for i in ids)
    data = []
    for i, v in enumerate(np.asarray(vecs, dtype="<f4")):
        emb: Any = base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
    return Response(msgspec.json.encode(body), media_type="application/json")


class _Inline:
    """What ``ServerState.off_loop`` asks of an engine: whether its work runs inline."""

    def __init__(self, runs_inline: bool):
        self.runs_inline = runs_inline


def routes(endpoint: Any) -> list[Any]:
    from starlette.routing import Route

    return [Route("/v1/embeddings", endpoint("embeddings", embeddings), methods=["POST"])]
