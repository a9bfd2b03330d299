"""Ember as a worker of the SGLang Model Gateway (``sglang-router``).

The gateway (``python -m sglang_router.launch_router --worker-urls … --policy
cache_aware``) treats every worker as an SGLang server. Two things follow, both
found by running sglang-router 0.3.2 in front of ``ember serve`` replicas
(docs/distributed.md):

* **Probes.** Registering a worker it calls ``GET /health``, then
  ``/server_info`` (falling back to ``/get_server_info``) and ``/model_info``
  (``/get_model_info``) for the served model's name; the ``power_of_two``
  policy polls ``GET /get_load``. Without a name the gateway registers the
  worker as model ``unknown`` and fills ``"model": "unknown"`` into requests
  that had none. ``routes()`` answers all of them from the engine's own state.

* **Request extensions.** The gateway re-serialises each OpenAI request through
  its own SGLang types, adding SGLang's sampling fields at their defaults:
  ``no_stop_trim``, ``continue_final_message``, ``skip_special_tokens``,
  ``separate_reasoning``, ``stream_reasoning``, ``return_hidden_states`` (and
  ``ignore_eos``/``echo``, which Ember already reads). Ember's schema forbids
  unknown fields so a user's misspelt one is a 400, not a silent no-op; that
  stays. A replica started with ``--trust-gateway`` decodes with
  ``GatewayChatCompletionRequest``/``GatewayCompletionRequest`` instead: the
  same strict types plus exactly the fields in ``SGLANG_EXTENSIONS``. Each is
  accepted at the value that means what Ember does anyway and is a 400 naming
  it otherwise (Ember cannot honour ``no_stop_trim: true`` or hidden states);
  the reasoning switches are no-ops for a server without a reasoning parser,
  so any value is accepted. Every accepted extension field is counted
  (``ember_gateway_extension_fields_total{field}``, and ``/server_info``).
  Any other unknown field is still a 400, with or without the flag.

Why a flag and not a header: the gateway sends no header of its own a replica
could trust, and the extension fields are harmless defaults; the flag only
widens the accepted set by a fixed list, for a replica that is reached
through the gateway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import InvalidRequest
from transport.openai_schema import ChatCompletionRequest, CompletionRequest


class ServerState(Protocol):
    """What the probes read of the server (``transport.http.ServerState``),
    named here so this module needs no import of the app that mounts it."""

    engine: Any
    config: Any
    trust_gateway: bool
    extensions: ExtensionCounter

    @property
    def model_name(self) -> str: ...

    def health(self) -> tuple[str, int]: ...


_ANY = object()

# field → the value Ember's behaviour already has (``_ANY``: every value is a no-op here)
SGLANG_EXTENSIONS: dict[str, Any] = {
    "no_stop_trim": False,  # Ember trims a matched stop string from the output, as OpenAI does
    "continue_final_message": False,  # a trailing assistant message is answered, not continued
    # mlx-lm's streaming detokenizer, as in mlx_lm.server: an EOS ends the output
    # and never becomes text; keeping special tokens as text is not offered
    "skip_special_tokens": True,
    "return_hidden_states": False,  # no hidden states in responses
    "separate_reasoning": _ANY,  # no reasoning parser: nothing to separate
    "stream_reasoning": _ANY,
}


# Added to both request types (``None``: the gateway did not send it). Made with
# ``defstruct`` because a msgspec Struct has one base with fields.
_FIELDS = [(name, bool | None, None) for name in SGLANG_EXTENSIONS]
GatewayChatCompletionRequest = msgspec.defstruct(
    "GatewayChatCompletionRequest", _FIELDS, bases=(ChatCompletionRequest,), kw_only=True, module=__name__
)
GatewayCompletionRequest = msgspec.defstruct(
    "GatewayCompletionRequest", _FIELDS, bases=(CompletionRequest,), kw_only=True, module=__name__
)
_GATEWAY_TYPES = (GatewayChatCompletionRequest, GatewayCompletionRequest)


def check_extensions(req: Any, seen: Counter[str]) -> None:
    """A 400 naming the first extension field Ember cannot honour; counts the rest."""
    present = []
    for name, neutral in SGLANG_EXTENSIONS.items():
        value = getattr(req, name)
        if value is None:
            continue
        if neutral is not _ANY and value != neutral:
            raise InvalidRequest(
                f"{name}={msgspec.json.encode(value).decode()} is not supported (an SGLang extension; "
                f"Ember accepts only {msgspec.json.encode(neutral).decode()})",
                name,
            )
        present.append(name)
    seen.update(present)


# SGLang's request types default ``model`` to this; the gateway sends it when
# the client named no model. From a trusted gateway it means "no model given".
GATEWAY_NO_MODEL = "unknown"


class ExtensionCounter(Collector):
    """Checks a trusted gateway's requests; counts each extension field accepted."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def check(self, req: Any) -> Any:
        if isinstance(req, _GATEWAY_TYPES):
            check_extensions(req, self.seen)
            if req.model == GATEWAY_NO_MODEL:  # type: ignore[attr-defined]  # both gateway types carry model
                req.model = None  # type: ignore[attr-defined]
        return req

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ember_gateway_extension_fields",
            "SGLang extension fields accepted from a trusted gateway",
            labels=["field"],
        )
        for name in SGLANG_EXTENSIONS:
            family.add_metric([name], self.seen[name])
        yield family


def request_type(chat: bool, trust_gateway: bool) -> type:
    if trust_gateway:
        return GatewayChatCompletionRequest if chat else GatewayCompletionRequest
    return ChatCompletionRequest if chat else CompletionRequest


# ---------------------------------------------------------------------------
# The probes.


def _host(request: Request) -> ServerState:
    return request.app.state.ember


async def server_info(request: Request) -> Response:
    """SGLang's ``/server_info`` fields the gateway reads (``served_model_name``,
    ``model_path``, batch limits), plus which extension fields were taken."""
    host = _host(request)
    engine = host.engine
    config = host.config
    body: dict[str, Any] = {
        "engine": "ember",
        "status": host.health()[0],
        "served_model_name": host.model_name,
        **_model_path(host),
        "dp_size": 1,
        "max_batch_size": config.max_batch,
        "max_running_requests": config.max_batch,
        "trust_gateway": host.trust_gateway,
        "gateway_extension_fields": dict(host.extensions.seen),
    }
    if engine is not None:
        body["max_total_tokens"] = engine.info.context_length
        body["context_length"] = engine.info.context_length
    return JSONResponse(body)


def _model_path(host: ServerState) -> dict[str, str]:
    """``model_path`` only as a local directory: the gateway loads a tokenizer
    from it, and takes anything else for a Hugging Face id to download (seen
    with the fake GPU's name). Without it the gateway skips the tokenizer,
    which its HTTP router does not need."""
    if host.config.backend != "mlx":
        return {}
    from engine.models import resolve_model

    try:
        return {"model_path": str(resolve_model(host.config.model))}
    except FileNotFoundError:
        return {}


async def model_info(request: Request) -> Response:
    host = _host(request)
    return JSONResponse(
        {
            **_model_path(host),
            "served_model_name": host.model_name,
            "is_generation": True,
            "model_type": "ember-fake" if host.config.backend == "fake" else "mlx-lm",
        }
    )


def load(host: ServerState) -> dict[str, int]:
    """SGLang's per-DP-rank load entry: requests running and waiting, and the
    tokens held by the running batch (what ``power_of_two`` compares)."""
    engine = host.engine
    if engine is None:
        return {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    core = engine.core
    running = [core.rows[rid] for rid in core.active if rid in core.rows]
    return {
        "dp_rank": 0,
        "num_reqs": len(running) + len(core.queue),
        "num_waiting_reqs": len(core.queue),
        "num_tokens": sum(r.in_cache for r in running),
    }


async def get_load(request: Request) -> Response:
    return JSONResponse([load(_host(request))])


async def health_generate(request: Request) -> Response:
    """SGLang's deep health check; here the engine's own status (a dead
    scheduler already makes it 503)."""
    status, code = _host(request).health()
    return JSONResponse({"status": status}, code)


def routes() -> list[Route]:
    return [
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
    ]
