"""The OpenAI-compatible HTTP adapter: a Starlette app over one ``Engine``.

    app = build_app(EngineConfig(backend="fake"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The lifespan opens the engine in the background, so ``/health`` answers 503
while a model loads (and while draining) instead of refusing connections; a
request that arrives before the engine is ready gets 503 too. Once ready, the
server phase decides the 503s, not which models are loaded: the registry may
unload any model, ``--model`` too (keep-alive, the memory budget, an admin
unload), and the next request for it loads it again. Shutting the lifespan
down closes ``Engine.open``, which drains: no new admissions, the running
requests finish, then the actors stop. Routes and error shapes are in
docs/http.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember import Engine, Ports
from ember.registry import (
    ModelBusy,
    ModelEntry,
    ModelLoadFailed,
    ModelLoadTimeout,
    ModelNotFound,
    Registry,
    parse_keep_alive,
)
from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.models import hub
from transport.anthropic import api as anthropic_api
from transport.openai import api as openai_api
from transport.openai import embeddings as embeddings_api
from transport.openai.bodies import ModelCard, ModelList
from transport.openai.gateway_compat import ExtensionCounter
from transport.openai.gateway_compat import routes as gateway_routes
from transport.responses import api as responses_api
from transport.server.security import SecurityMiddleware
from transport.server.ui_routes import routes as ui_routes
from transport.turn import cache_miss, chat_turn
from transport.wire.api_keys import Keys
from transport.wire.envelope import EnvelopeCounter
from transport.wire.errors import ApiError, error_body
from transport.wire.metrics import CONTENT_TYPE, Metrics
from transport.wire.request_io import endpoint, message_texts

log = logging.getLogger("ember.http")

MAX_BODY_BYTES = 8 << 20
# A prompt longer than ``context_length × PROMPT_BYTES_PER_TOKEN`` UTF-8 bytes
# cannot fit the context: no tokenizer in use averages anywhere near 64 bytes
# a token (English text is ~4), so it is a 400 before any tokenizing. What
# passes is tokenized and templated off the event loop (``ServerState.off_loop``).
PROMPT_BYTES_PER_TOKEN = 64
# A streaming client whose socket accepts nothing for this long is aborted
# (it would otherwise hold its admission slot until max_tokens).
SEND_TIMEOUT_S = 30.0
TOKENIZE_THREADS = 2  # hostile long prompts queue here, not on the event loop or on every CPU


class ServerState:
    """What the routes see: the phase, and the engine once it is open."""

    def __init__(
        self,
        config: EngineConfig,
        engine_kw: dict[str, Any],
        *,
        keepalive_s: float,
        default_max_tokens: int | None,
        max_body_bytes: int,
        trust_gateway: bool = False,
        send_timeout_s: float | None = None,
        registry_kw: dict[str, Any] | None = None,
        models: dict[str, EngineConfig] | None = None,
    ):
        self.config = config
        self.trust_gateway = (
            trust_gateway  # accept the SGLang gateway's extension fields (transport/openai/gateway_compat.py)
        )
        self.extensions = ExtensionCounter()
        self.send_timeout_s = send_timeout_s
        self.engine_kw = engine_kw
        self.keepalive_s = keepalive_s
        self.default_max_tokens = default_max_tokens  # the operator's cap on an unset limit (None: the context left)
        self.max_body_bytes = max_body_bytes
        # the router: every model this server can serve, the default (--model) among them (ember/registry.py)
        self.registry = Registry(config, default=self.default_name(), ports=Ports(**engine_kw), **(registry_kw or {}))
        for name, cfg in (models or {}).items():
            self.registry.add_chat(name, cfg.validate(), source="config")
        self.phase = "starting"  # starting → ready → draining → stopped, or starting → failed
        self.error: BaseException | None = None
        self.created = int(time.time())
        self.metrics = Metrics(self.loaded_stats)  # every loaded model's series, labelled by name
        self.metrics.registry.register(self.extensions)
        # envelope fields the clients send, accepted or rewritten (transport/wire/envelope.py)
        self.envelope = EnvelopeCounter()
        self.metrics.registry.register(self.envelope)
        self.settled: anyio.Event | None = None  # set once ready or failed (made on the serving loop)
        self._stop: anyio.Event | None = None
        self._tokenize_limiter: anyio.CapacityLimiter | None = None

    # ---- lifecycle -------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.settled, self._stop = anyio.Event(), anyio.Event()
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.registry.run)
                try:
                    await self._serve()
                finally:
                    await self.registry.shutdown()  # every loaded model drains and flushes
                    tg.cancel_scope.cancel()
            if self.phase != "failed":
                self.phase = "stopped"
        finally:
            self.settled.set()

    async def _serve(self) -> None:
        assert self._stop is not None and self.settled is not None
        try:
            while True:  # the default model loads off the loop (ember/registry.py): /health answers meanwhile
                try:
                    await self.registry.engine_for(None)
                    break
                except ModelLoadTimeout:
                    continue  # no request waits on it: the startup load has no deadline
            self.phase = "ready"
            self.settled.set()
            log.info("[http] ready model=%s", self.model_name)
            await self._stop.wait()
            self.phase = "draining"
            log.info("[http] draining models=%s", [e.name for e in self.registry.loaded()])
        except Exception as exc:
            what = "failed to start" if self.phase == "starting" else "stopped with an error"
            self.error = exc
            self.phase = "failed"
            log.error("[http] the engine %s: %r", what, exc)
            log.debug("[http] engine failure", exc_info=exc)

    @property
    def engine(self) -> Engine | None:
        """The default model's engine while it is loaded, else None (the registry may unload it):
        for what reads its stats. A route that needs the model calls ``engine_for``, which loads it."""
        entry = self.registry.entries.get(self.registry.default or "")
        return entry.engine if entry is not None and entry.state == "loaded" else None

    def loaded_entries(self) -> list[ModelEntry]:
        """The models loaded now, the default first (/health, /metrics)."""
        return sorted(self.registry.loaded(), key=lambda e: e.name != self.registry.default)

    def loaded_stats(self) -> dict[str, dict[str, Any]]:
        """Each loaded model's ``engine.stats()`` by its served name, the default first (/metrics)."""
        return {e.name: e.engine.stats() for e in self.loaded_entries()}

    def default_name(self) -> str:
        """The default model's served name, known before it loads (see ``model_name``)."""
        if self.config.model_name:
            return self.config.model_name
        if self.config.backend == "mlx":
            return self.config.model
        if self.config.backend == "scripted":
            return "scripted"  # engine.fake.scripted's model_id, which the agent clients are given
        backend = self.engine_kw.get("backend")
        info = getattr(backend, "info", None)
        return info.model_id if info is not None else f"fake-gpu-{self.config.fake.seed}"

    async def drain_all(self) -> bool:
        """Drain every loaded model at once (each finishes its requests and flushes);
        True if all of them did within their deadline. The server is draining from
        here: /health and new requests answer 503, and no model loads again."""
        if self.phase == "ready":
            self.phase = "draining"
        results: list[bool] = []

        async def one(engine: Any) -> None:
            results.append(bool(await engine.drain()))

        async with anyio.create_task_group() as tg:
            for e in self.registry.loaded():
                if hasattr(e.engine, "drain"):
                    tg.start_soon(one, e.engine)
        return all(results)

    def stop(self, scope: anyio.CancelScope) -> None:
        if self.phase == "starting":
            scope.cancel()  # nothing to drain yet: abandon the load
        if self._stop is not None:
            self._stop.set()

    # ---- what routes need ------------------------------------------------
    async def off_loop(self, fn: Callable[..., Any], *args: Any, engine: Any = None) -> Any:
        """Run CPU work a request brings (tokenizing, chat templates) on a
        worker thread, so /health and other streams keep their latency; inline
        when the engine runs in virtual time (its device is inline: no threads)."""
        engine = engine if engine is not None else self.engine
        if engine is None or engine.runs_inline:
            return fn(*args)
        if self._tokenize_limiter is None:
            self._tokenize_limiter = anyio.CapacityLimiter(TOKENIZE_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._tokenize_limiter)

    def check_prompt_bytes(self, texts: list[str], param: str, engine: Any = None) -> None:
        """The byte bound, checked before tokenizing (see PROMPT_BYTES_PER_TOKEN)."""
        engine = engine if engine is not None else self.engine
        assert engine is not None
        cap = engine.info.context_length * PROMPT_BYTES_PER_TOKEN
        n = 0
        for t in texts:
            n += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))
            if n > cap:
                # InvalidRequest, not ApiError: every API maps it to its own 400 shape
                raise InvalidRequest(
                    f"the prompt is longer than the context can hold: over {cap} bytes of text "
                    f"({engine.info.context_length} tokens × {PROMPT_BYTES_PER_TOKEN} bytes, a bound no tokenizer reaches)",
                    param,
                )

    async def chat_prompt(
        self,
        engine: Engine,
        messages: list[dict[str, Any]],
        setup: Any,
        param: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
        ns: str = "",
    ) -> Any:
        """``chat_turn.chat_prompt`` behind the byte bound and off the event
        loop: what every chat-shaped route (chat completions, Messages,
        Responses) renders its prompt with. ``template_kwargs`` go to the chat
        template (e.g. ``enable_thinking``); ``ns`` is the request's cache namespace."""
        self.check_prompt_bytes(message_texts(messages), param, engine)
        return await self.off_loop(
            chat_turn.chat_prompt, engine, messages, setup, param, template_kwargs, ns, engine=engine
        )

    def health(self) -> tuple[str, int]:
        """The phase decides; once ready, the default model's engine speaks for the
        server while it is loaded (draining, dead: 503). Unloaded, it is no outage:
        the next request for it loads it again."""
        engine = self.engine
        if self.phase == "ready" and engine is not None:
            status = engine.status
            return status, 200 if status == "ready" else 503
        return self.phase, 200 if self.phase == "ready" else 503

    def require_ready(self) -> None:
        """503 unless the server is ready (starting, draining, a failed start, stopped).
        Whether a model is loaded is no reason: ``engine_for`` loads it."""
        if self.phase != "ready":
            code = "engine_starting" if self.phase == "starting" else "engine_draining"
            if self.phase == "failed":
                code = "engine_dead"
            raise ApiError(503, f"the server is {self.phase}", "server_error", code=code, headers={"retry-after": "1"})

    @property
    def model_name(self) -> str:
        """``--served-model-name``, else the model as named on the command line
        (``tiny`` or a path, like mlx_lm.server), else the fake GPU's id."""
        return self.registry.default or self.default_name()

    def entry(self, requested: str | None) -> ModelEntry:
        """The registry entry a request's ``model`` names; 404 listing the names otherwise."""
        try:
            return self.registry.resolve(requested)
        except ModelNotFound as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None

    def adapter_id(self, requested: str | None) -> str:
        """The id (``NAME@HASH``) of the LoRA adapter a request's ``model``
        names (``--adapter``), for its cache namespace; empty: the base model."""
        spec = self.registry.adapter_for(requested)
        return spec.id if spec is not None else ""

    def check_model(self, requested: str | None) -> str:
        """The served name of the model a request names (aliases resolved), or a 404 listing the names."""
        return self.entry(requested).name

    async def engine_for(self, requested: str | None, kind: str = "chat", keep_alive: Any = None) -> tuple[Any, str]:
        """The routed engine and its served name: the model a request names,
        loaded first if need be (concurrent requests for it wait, bounded).
        Unknown: 404 listing the names; the wrong kind (chat to an embedding
        model, or back): 400; a failed load: 500 naming the cause; a load
        that takes too long, or too many waiting: 503."""
        self.require_ready()
        entry = self.entry(requested)
        if entry.kind != kind:
            what = "an embedding model: use /v1/embeddings" if entry.kind == "embed" else "not an embedding model"
            raise ApiError(400, f"the model {entry.name!r} is {what}", param="model", code="model_wrong_kind")
        try:
            keep = parse_keep_alive(keep_alive)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="keep_alive") from None
        try:
            engine = await self.registry.engine_for(entry.name, keep_alive_s=keep)
        except ModelLoadFailed as exc:
            raise ApiError(500, str(exc), "server_error", param="model", code="model_load_failed") from None
        except (ModelLoadTimeout, ModelBusy) as exc:
            code = "model_load_timeout" if isinstance(exc, ModelLoadTimeout) else "model_busy"
            raise ApiError(503, str(exc), "server_error", code=code, headers={"retry-after": "5"}) from None
        if engine.status != "ready":
            code = "engine_dead" if engine.status == "dead" else "engine_draining"
            raise ApiError(
                503,
                f"the model {entry.name!r} is {engine.status}",
                "server_error",
                code=code,
                headers={"retry-after": "1"},
            )
        self.require_ready()  # the server began draining during the load
        adapter = self.registry.adapter_for(requested)  # answers name the adapter asked for
        return engine, adapter.name if adapter is not None else entry.name


# ---------------------------------------------------------------------------
# Routes.


def model_card(host: ServerState, entry: ModelEntry) -> ModelCard:
    c = entry.card()
    ctx = c["context_length"]
    aliases = sorted(a for a, t in host.registry.aliases.items() if t == entry.name)
    return ModelCard(
        id=entry.name,
        created=host.created,
        context_length=ctx,
        max_model_len=ctx,
        state=entry.state,
        kind=entry.kind,
        memory_bytes=c["memory_bytes"],
        size_bytes=c["size_bytes"],
        pinned=entry.pinned,
        keep_alive_s=entry.keep_alive_s,
        aliases=aliases or None,
        error=entry.error,
    )


def adapter_card(host: ServerState, name: str) -> ModelCard:
    """A LoRA adapter's card (``--adapter``): its base model's, named for it."""
    assert host.registry.default is not None  # adapters are the default model's
    base = host.registry.entries[host.registry.default]
    card = model_card(host, base)
    return msgspec.structs.replace(card, id=name, kind="adapter", parent=base.name, aliases=None)


async def models(request: Request, host: ServerState) -> Response:
    """Every name the registry can serve, the default first, with its state."""
    host.registry.refresh_memory()
    entries = sorted(host.registry.entries.values(), key=lambda e: (e.name != host.registry.default, e.name))
    cards = [model_card(host, e) for e in entries]
    if host.registry.default is not None:  # --adapter's LoRA adapters, after their base model
        cards += [adapter_card(host, spec.name) for spec in host.registry.base.adapters]
    return Response(msgspec.json.encode(ModelList(data=cards)), media_type="application/json")


async def model_detail(request: Request, host: ServerState) -> Response:
    host.registry.refresh_memory()
    name = request.path_params["model"]
    adapter = host.registry.adapter_for(name)
    card = adapter_card(host, adapter.name) if adapter is not None else model_card(host, host.entry(name))
    return Response(msgspec.json.encode(card), media_type="application/json")


async def model_load(request: Request, host: ServerState) -> Response:
    """``POST /admin/models/{id}/load``: load now (waits for it); the card after."""
    entry = host.entry(request.path_params["model"])
    host.require_ready()
    try:
        await host.registry.engine_for(entry.name)
    except ModelLoadFailed as exc:
        raise ApiError(500, str(exc), "server_error", param="model", code="model_load_failed") from None
    except (ModelLoadTimeout, ModelBusy) as exc:
        raise ApiError(503, str(exc), "server_error", code="model_busy", headers={"retry-after": "5"}) from None
    return Response(msgspec.json.encode(model_card(host, entry)), media_type="application/json")


async def model_unload(request: Request, host: ServerState) -> Response:
    """``POST /admin/models/{id}/unload``: drain its requests, flush, free; the card after
    (``"unloaded": false`` when it was not loaded). The next request for it loads it again."""
    entry = host.entry(request.path_params["model"])
    done = await host.registry.unload(entry.name)
    body = {**msgspec.to_builtins(model_card(host, entry)), "unloaded": done}
    return JSONResponse(body)


async def health(request: Request, host: ServerState) -> Response:
    """``{"status": ..., "loaded": [names]}`` (the models loaded now, the default first:
    any other loads on its first request); while a hub model downloads (``--model ORG/NAME``
    at start, or a request's pull), ``"pulls": [{"model", "done_bytes", "total_bytes"}]`` too."""
    status, code = host.health()
    body: dict[str, Any] = {"status": status, "loaded": [e.name for e in host.loaded_entries()]}
    pulls = hub.in_flight()
    if pulls:
        body["pulls"] = pulls
    return JSONResponse(body, code)


def _plain(obj: Any) -> Any:
    """Stats may hold numpy scalars or other objects: numbers stay numbers, the rest is text."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


async def stats(request: Request, host: ServerState) -> Response:
    """The default model's engine stats top-level (absent while it is unloaded: reading stats
    loads nothing), the server's counters, and a section for each model held."""
    host.require_ready()
    engine = host.engine
    default = host.registry.entries.get(host.registry.default or "")
    body: dict[str, Any] = {
        **(engine.stats() if engine is not None else {}),
        "default_model": {"name": host.model_name, "state": default.state if default is not None else None},
        "envelope": host.envelope.snapshot(),
        "tool_calls": host.metrics.tool_calls.snapshot(),
        "recent_requests": host.metrics.recent.snapshot(),
    }
    if engine is not None:  # the last few explained (transport/turn/cache_miss.py)
        body["cache_misses"] = cache_miss.miss_log(engine).stats()
    reg = host.registry.stats()  # the default model's stats stay top-level; every held model gets a section
    body["models"] = {
        name: {**m.pop("stats", {}), "registry": m}
        for name, m in reg.pop("models").items()
        if m["state"] != "available"
    }
    body["registry"] = reg
    return Response(msgspec.json.encode(body, enc_hook=_plain), media_type="application/json")


async def cache_flush(request: Request, host: ServerState) -> Response:
    """``POST /admin/cache/flush``: the durability boundary. 200 only when every
    finished prefix and queued spill is on SSD (renamed, folder fsynced), 503
    otherwise; the body is the evidence either way (``FlushReport``). The default
    model unloaded: the flush its unload ran is the answer (nothing has run since)."""
    host.require_ready()
    engine = host.engine
    report = await engine.aflush() if engine is not None else host.registry.last_flush(host.model_name)
    return Response(msgspec.json.encode(report), 200 if report.durable else 503, media_type="application/json")


async def metrics(request: Request, host: ServerState) -> Response:
    return Response(host.metrics.render(), media_type=CONTENT_TYPE)


def agent_routes() -> list[Route]:
    """The Anthropic Messages and OpenAI Responses routes, each with its own error shape."""
    return anthropic_api.routes() + responses_api.routes(endpoint) + embeddings_api.routes(endpoint)


# ---------------------------------------------------------------------------
# The app.


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = ApiError(exc.status_code, exc.detail or "error", code="not_found" if exc.status_code == 404 else None)
    return Response(error_body(err), exc.status_code, headers=exc.headers, media_type="application/json")


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("[http] unhandled %r on %s", exc, request.url.path, exc_info=exc)
    err = ApiError(500, "internal server error", "server_error")
    return Response(error_body(err), 500, media_type="application/json")


def build_app(
    config: EngineConfig,
    *,
    keepalive_s: float = 5.0,
    default_max_tokens: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    trust_gateway: bool = False,
    api_key: str | None = None,
    api_keys: Keys | None = None,
    loopback_only: bool = False,
    send_timeout_s: float | None = SEND_TIMEOUT_S,
    registry_kw: dict[str, Any] | None = None,
    more_models: dict[str, EngineConfig] | None = None,
    **engine_kw: Any,
) -> Starlette:
    """The app serving the default model (``config``) and the registry's others; ``engine_kw`` are the
    default's ports (``ember.Ports``: backend, clock, events…). ``registry_kw`` go to ``ember.registry.Registry``
    (models_dir, keep_alive_s, max_memory, pins, aliases, load_timeout_s); ``more_models`` adds named chat models.

    ``api_key`` (one shared key), ``api_keys`` (named keys, each its own
    cache scope: ``transport.wire.api_keys.KeysFile``) and ``loopback_only`` (the
    CLI sets it when bound to a loopback address) configure
    ``transport.server.security``, which guards every route, including ones added later."""
    config = config.validate()  # a bad combination fails here, before anything listens
    host = ServerState(
        config,
        engine_kw,
        keepalive_s=keepalive_s,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        trust_gateway=trust_gateway,
        send_timeout_s=send_timeout_s,
        registry_kw=registry_kw,
        models=more_models,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            await tg.start(host.run)
            try:
                yield
            finally:
                host.stop(tg.cancel_scope)

    routes = [
        *openai_api.routes(),  # /v1/chat/completions, /v1/completions
        Route("/v1/models", endpoint("models", models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("models", model_detail), methods=["GET"]),
        Route("/health", endpoint("health", health), methods=["GET"]),
        Route("/stats", endpoint("stats", stats), methods=["GET"]),
        Route("/metrics", endpoint("metrics", metrics), methods=["GET"]),
        Route("/admin/cache/flush", endpoint("cache_flush", cache_flush), methods=["POST"]),
        Route("/admin/models/{model:path}/load", endpoint("model_load", model_load), methods=["POST"]),
        Route("/admin/models/{model:path}/unload", endpoint("model_unload", model_unload), methods=["POST"]),
        *gateway_routes(),  # what the SGLang Model Gateway probes
        *ui_routes(),  # GET / and /ui: the dashboard and chat playground (transport/server/ui_routes.py)
    ]
    routes += agent_routes()
    app = Starlette(
        routes=routes,
        middleware=[Middleware(SecurityMiddleware, api_key=api_key, keys=api_keys, loopback_only=loopback_only)],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.ember = host
    # the dashboard page asks for it first (transport/server/ui_routes.py)
    app.state.api_key_required = api_key is not None or api_keys is not None
    return app
