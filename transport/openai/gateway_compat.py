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
  ``ignore_eos``/``echo``, which Ember already reads). The gateway is a client
  like any other (issue #29): at their neutral values — the value that means
  what Ember does anyway — these six are envelope fields, accepted on every
  replica and counted (``ember_envelope_fields_total{route, field,
  action="ignored"}``, and ``ember_gateway_extension_fields_total{field}`` /
  ``/server_info``). Every request decodes with
  ``GatewayChatCompletionRequest``/``GatewayCompletionRequest``: the same
  strict types plus exactly the fields in ``SGLANG_EXTENSIONS``. A value Ember
  cannot honour (``no_stop_trim: true``, hidden states, a continued final
  message, special tokens as text, reasoning left in the answer of a model
  that reasons) is a 400 naming the field. Any other unknown field is still a
  400: a misspelt field is never a silent no-op.

``--trust-gateway`` is kept as a documented no-op alias (the fields no longer
need it); ``/server_info`` still reports it.
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
from transport.openai.schema import ChatCompletionRequest, CompletionRequest


class ServerState(Protocol):
    """What the probes read of the server (``transport.server.http.ServerState``),
    named here so this module needs no import of the app that mounts it."""

    engine: Any
    config: Any
    trust_gateway: bool
    extensions: ExtensionCounter

    @property
    def model_name(self) -> str: ...

    def health(self) -> tuple[str, int]: ...


# field → the value Ember's behaviour already has
SGLANG_EXTENSIONS: dict[str, bool] = {
    "no_stop_trim": False,  # Ember trims a matched stop string from the output, as OpenAI does
    "continue_final_message": False,  # a trailing assistant message is answered, not continued
    # mlx-lm's streaming detokenizer, as in mlx_lm.server: an EOS ends the output
    # and never becomes text; keeping special tokens as text is not offered
    "skip_special_tokens": True,
    "return_hidden_states": False,  # no hidden states in responses
    # a reasoning model's <think> section always comes out apart from the answer
    # (transport/turn/reasoning.py), streamed as it is written; on a model that does
    # not reason there is nothing to separate and any value is a no-op
    "separate_reasoning": True,
    "stream_reasoning": True,
}
_REASONING_SWITCHES = ("separate_reasoning", "stream_reasoning")


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


def check_extensions(req: Any, seen: Counter[str], reasons: bool = True) -> list[str]:
    """A 400 naming the first extension field Ember cannot honour; counts the
    rest in ``seen`` and returns their names. ``reasons``: the model has a
    reasoning section to separate (else the reasoning switches take any value)."""
    present = []
    for name, neutral in SGLANG_EXTENSIONS.items():
        value = getattr(req, name)
        if value is None:
            continue
        if value != neutral and (reasons or name not in _REASONING_SWITCHES):
            raise InvalidRequest(
                f"{name}={msgspec.json.encode(value).decode()} is not supported (an SGLang extension; "
                f"Ember accepts only {msgspec.json.encode(neutral).decode()})",
                name,
            )
        present.append(name)
    seen.update(present)
    return present


# SGLang's request types default ``model`` to this; the gateway sends it when
# the client named no model. From a trusted gateway it means "no model given".
GATEWAY_NO_MODEL = "unknown"


def requested_model(req: Any) -> str | None:
    """The model a decoded request names: SGLang's default ``"unknown"`` from
    the gateway (a request carrying its fields) means none, as in ``check``."""
    model = getattr(req, "model", None)
    from_gateway = isinstance(req, _GATEWAY_TYPES) and any(getattr(req, n) is not None for n in SGLANG_EXTENSIONS)
    return None if model == GATEWAY_NO_MODEL and from_gateway else model


class ExtensionCounter(Collector):
    """Checks the gateway's extension fields on every request; counts each one accepted."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def check(self, req: Any, envelope: Any = None, route: str = "chat", reasons: bool = True) -> Any:
        """``req`` with its extension fields checked and counted (also as
        envelope fields of ``route``). ``"model": "unknown"`` means no model
        named when the request came through the gateway (it carries the
        gateway's fields), as SGLang's types default it."""
        if isinstance(req, _GATEWAY_TYPES):
            present = check_extensions(req, self.seen, reasons)
            if envelope is not None:
                for name in present:
                    envelope.note(route, name, "ignored")
            if present and req.model == GATEWAY_NO_MODEL:  # type: ignore[attr-defined]  # both gateway types carry model
                req.model = None  # type: ignore[attr-defined]
        return req

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ember_gateway_extension_fields",
            "SGLang Model Gateway extension fields accepted (at their neutral values)",
            labels=["field"],
        )
        for name in SGLANG_EXTENSIONS:
            family.add_metric([name], self.seen[name])
        yield family


def request_type(chat: bool, trust_gateway: bool = False) -> type:
    """The request type of a chat or completion: the strict one plus the
    gateway's fields, with or without ``--trust-gateway`` (now a no-op alias)."""
    del trust_gateway
    return GatewayChatCompletionRequest if chat else GatewayCompletionRequest


# ---------------------------------------------------------------------------
# The probes.


def _host(request: Request) -> ServerState:
    return request.app.state.ember


async def server_info(request: Request) -> Response:
    """SGLang's ``/server_info`` fields the gateway reads (``served_model_name``,
    ``model_path``, batch limits), plus which extension fields were taken."""
    host = _host(request)
    engine = host.engine  # None while the registry has the default model unloaded: its limits are left out
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
    from engine.models import hub, resolve_model

    try:  # never a download here, on the event loop: a hub model not pulled yet has no path
        return {"model_path": str(resolve_model(host.config.model, pull=False))}
    except (FileNotFoundError, hub.HubError):
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
    if engine is None:  # the default model is unloaded: nothing runs on it
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
