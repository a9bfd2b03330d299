"""The one road every generation route runs on (issue 44): parse → canonical
turn → render the prompt → admit → stream or collect → finish.

Chat completions and completions (transport/openai/api.py), Anthropic
Messages (transport/anthropic/api.py) and OpenAI Responses
(transport/responses/api.py) each hand ``run_turn`` a ``ChatRoute``: its
door. A door says how its body decodes, which model it names, how its request
becomes a canonical ``Turn`` (template messages, tools, the thinking switch),
what its request adds to the sampling parameters, and how the answer is
encoded, nothing else. Every per-request setting is applied here, once, for
all of them: the engine check and the body cap, the model and its
``keep_alive``, the cache namespace (API key and adapter), the metrics timer,
the prompt's byte bound and template, the output limit (``output_limit``),
tools and their grammar, the engine's field names in errors, admission of one
row per choice, the tool-call counter and call splitter of the route, and the
stream's keep-alive and send deadline (``chat_turn.respond`` →
``request_io.event_stream``). ``count_prompt`` runs the first half, for
Anthropic's ``count_tokens``.

(mlx-lm's one ``handle_completion``, vLLM's ``OpenAIServing`` with its one
``get_max_tokens`` are the shape.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from ember.api import Engine
from engine.errors import InvalidRequest
from engine.types import SamplingParams
from transport.turn import chat_turn
from transport.turn.choices import ChoiceStream, submit_choices
from transport.turn.tools import ToolSetup
from transport.wire.limits import output_limit
from transport.wire.metrics import TokenTimer
from transport.wire.request_io import read_body, request_namespace
from transport.wire.sse import Renderer


class TurnRequest(Protocol):
    """What the road reads of a decoded request, whichever API's it is; the
    rest is its door's to read."""

    keep_alive: float | str | None  # Ollama's: seconds or "5m" (ember/registry.py)
    stream: bool

    def requested_max_tokens(self) -> int | None:
        """The output limit the client allows (None: unset), before ``output_limit``."""
        ...

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's settings, ``max_tokens`` being the resolved output limit."""
        ...

    def param_names(self) -> dict[str, str]:
        """The engine's field names as this request spells them, for its errors."""
        ...


class Host(Protocol):
    """What the road uses of the server (transport/server/http.py ``ServerState``)."""

    max_body_bytes: int
    default_max_tokens: int | None  # the operator's cap on an unset limit
    keepalive_s: float
    send_timeout_s: float | None
    metrics: Any  # transport.wire.metrics.Metrics
    envelope: Any  # transport.wire.envelope.EnvelopeCounter

    def require_ready(self) -> None: ...

    def adapter_id(self, requested: str | None) -> str: ...

    async def engine_for(
        self, requested: str | None, kind: str = "chat", keep_alive: Any = None
    ) -> tuple[Any, str]: ...

    def check_prompt_bytes(self, texts: list[str], param: str, engine: Any = None) -> None: ...

    async def off_loop(self, fn: Callable[..., Any], *args: Any, engine: Any = None) -> Any: ...

    async def chat_prompt(
        self,
        engine: Engine,
        messages: list[dict[str, Any]],
        setup: Any,
        param: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
        ns: str = "",
    ) -> Any: ...


@dataclass(kw_only=True)
class Turn:
    """A request as the road reads it, whichever API it came in by: a chat's
    OpenAI-style template ``messages`` (or a completion's raw ``text``), its
    tools and its thinking switch."""

    messages: list[dict[str, Any]] | None = None
    text: str | list[int] | None = None  # a completion's prompt: text to encode, or token ids (no template)
    tools: ToolSetup = field(default_factory=ToolSetup)
    thinking: bool | None = None  # reasoning on/off; None: the template's default
    thinking_field: str = ""  # the field the switch came in, for the envelope count
    param: str = "messages"  # the field a template's refusal is reported on
    # Messages to render instead when the template refuses ``messages`` (None:
    # the refusal stands), and the envelope note that says it happened.
    retry: Callable[[InvalidRequest], list[dict[str, Any]] | None] | None = None
    retry_note: tuple[str, str] | None = None
    state: Any = None  # the door's own, for its encoder (Responses: the stored conversation)


@dataclass(kw_only=True)
class Opened:
    """A decoded request on its engine: what a door's ``turn`` reads."""

    route: str
    req: Any  # a TurnRequest; its door reads the rest of it
    host: Any  # a Host: the server's ServerState (transport/server/http.py)
    engine: Engine
    model: str  # the served name the answer carries
    ns: str  # the cache namespace: API key and adapter (request_io.request_namespace)

    def note(self, field: str, action: str) -> None:
        """An envelope field of this route, counted (transport/wire/envelope.py)."""
        self.host.envelope.note(self.route, field, action)


@dataclass(kw_only=True)
class Admitted:
    """An admitted turn: what a door's ``encoder`` builds its renderer from."""

    opened: Opened
    turn: Turn
    prompt: list[int]  # a chat_turn.Prompt for a chat
    params: SamplingParams  # the first choice's
    rids: list[int]  # one per choice
    splitter: Callable[[], Any]  # a new call/reasoning splitter (None: the text is the answer)


class ChatRoute:
    """One API's door onto the road. The defaults are the neutral ones; a door
    overrides what its API spells its own way."""

    name = "chat"  # its label in /metrics: answers, tool calls, envelope fields
    call_id_prefix = "call_"  # the ids its tool calls get

    def decode(self, body: bytes, host: Any) -> TurnRequest:
        """The request Struct (transport.turn.decode.decode_request)."""
        raise NotImplementedError

    def model(self, req: Any) -> str | None:
        return req.model

    def turn(self, o: Opened) -> Turn:
        """The canonical turn; envelope fields go to ``o.note``."""
        raise NotImplementedError

    def sampling_params(self, o: Opened, turn: Turn, limit: int) -> SamplingParams:
        """The engine's settings at output limit ``limit``, with what only this API adds."""
        return o.req.sampling_params(limit, o.engine.info.vocab_size)

    def param_names(self, req: Any) -> dict[str, str]:
        """The engine's field names as this request spells them, for its errors."""
        return req.param_names()

    def choices(self, req: Any, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per row to admit."""
        return [params]

    def encoder(self, a: Admitted) -> Renderer:
        """The renderer that writes the answer (a body, or the stream's events)."""
        raise NotImplementedError


async def run_turn(request: Request, host: Host, route: ChatRoute) -> Response:
    """One generation request, from its bytes to its answer."""
    o = await _open(request, host, route)
    timer = TokenTimer(host.metrics, o.engine.clock.now, o.model)  # from before the template: TTFT includes it
    turn = route.turn(o)
    prompt = await _render(o, turn)
    limit = output_limit(
        o.req.requested_max_tokens(), len(prompt), o.engine.info.context_length, host.default_max_tokens
    )
    params = chat_turn.tool_params(o.engine, route.sampling_params(o, turn, limit), turn.tools)
    names = route.param_names(o.req)
    if turn.tools.forced:  # the constraint is the forced call's
        names["constraint"] = turn.tools.param_choice
    stream = await submit_choices(o.engine, prompt, route.choices(o.req, params), names, o.ns)
    count = host.metrics.tool_calls.for_route(route.name)
    chat = prompt if isinstance(prompt, chat_turn.Prompt) else None  # where the output starts (in a <think>?)
    renderer = route.encoder(
        Admitted(
            opened=o,
            turn=turn,
            prompt=prompt,
            params=params,
            rids=stream.rids if isinstance(stream, ChoiceStream) else [stream.rid],
            splitter=functools.partial(
                chat_turn.splitter, o.engine, turn.tools, route.call_id_prefix, prompt=chat, count=count
            ),
        )
    )
    return await chat_turn.respond(request, host, o.engine, prompt, stream, renderer, o.req.stream, timer)


async def count_prompt(request: Request, host: Host, route: ChatRoute) -> list[int]:
    """The prompt a request would run with, admitting nothing."""
    o = await _open(request, host, route)
    return await _render(o, route.turn(o))


async def _open(request: Request, host: Host, route: ChatRoute) -> Opened:
    host.require_ready()  # before reading the body: a server starting or draining answers 503 at once
    req = route.decode(await read_body(request, host.max_body_bytes), host)
    model = route.model(req)
    ns = request_namespace(request, host.adapter_id(model))
    engine, served = await host.engine_for(model, keep_alive=req.keep_alive)
    return Opened(route=route.name, req=req, host=host, engine=engine, model=served, ns=ns)


async def _render(o: Opened, turn: Turn) -> list[int]:
    """The prompt's ids: a chat through the model's template (behind the byte
    bound, off the loop), a completion's text encoded, its ids as they are."""
    host, engine = o.host, o.engine
    if isinstance(turn.text, str):
        host.check_prompt_bytes([turn.text], "prompt", engine)
        return await host.off_loop(engine.encode, turn.text, engine=engine)
    if turn.text is not None:
        return engine.encode(turn.text)
    assert turn.messages is not None, "a door's turn has messages or a text"
    thinking = chat_turn.thinking_kwargs(host, engine, o.route, turn.thinking_field, turn.thinking)

    async def render(messages: list[dict[str, Any]]) -> list[int]:
        return await host.chat_prompt(engine, messages, turn.tools, turn.param, template_kwargs=thinking, ns=o.ns)

    try:
        return await render(turn.messages)
    except InvalidRequest as exc:
        instead = turn.retry(exc) if turn.retry is not None else None
        if instead is None:
            raise
    prompt = await render(instead)
    if turn.retry_note is not None:
        o.note(*turn.retry_note)
    return prompt
