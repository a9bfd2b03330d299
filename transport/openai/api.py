"""The OpenAI chat completions and completions routes: their doors onto the
one road (transport/turn/road.py). A door decodes the request (``schema``,
``gateway_compat``), says what it asks for as a canonical turn, and encodes
the answer (``render``); the road does the rest. ``host`` is the server's
``ServerState`` (transport.server.http), which mounts ``routes()``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.types import SamplingParams
from transport.openai.gateway_compat import request_type, requested_model
from transport.openai.render import ChatRenderer, CompletionRenderer
from transport.openai.schema import ChatCompletionRequest, CompletionRequest
from transport.turn import reasoning, road
from transport.turn.decode import decode_request
from transport.turn.road import Admitted, ChatRoute, Opened, Turn
from transport.wire.request_io import endpoint
from transport.wire.sse import Renderer


class _OpenAIRoute(ChatRoute):
    chat = True

    def decode(self, body: bytes, host: Any) -> ChatCompletionRequest | CompletionRequest:
        return decode_request(body, request_type(self.chat, host.trust_gateway))

    def model(self, req: Any) -> str | None:
        return requested_model(req)  # the gateway's "unknown" is no model named

    def checked(self, o: Opened) -> Any:
        """The request with the gateway's extension fields checked and counted."""
        thinks = reasoning.markup_of(o.engine.tokenizer) is not None
        return o.host.extensions.check(o.req, o.host.envelope, self.name, thinks)

    def choices(self, req: Any, params: SamplingParams) -> list[SamplingParams]:
        return req.choice_params(params)  # n choices, each its own seed stream


class ChatCompletions(_OpenAIRoute):
    name = "chat"

    def turn(self, o: Opened) -> Turn:
        req = o.req = self.checked(o)
        thinking_field = (
            "chat_template_kwargs" if "enable_thinking" in (req.chat_template_kwargs or {}) else "reasoning_effort"
        )
        return Turn(
            tools=req.tool_setup(),
            thinking=req.thinking_choice(),
            thinking_field=thinking_field,
            messages=[m.as_template_message() for m in req.messages],
        )

    def encoder(self, a: Admitted) -> Renderer:
        o = a.opened
        return ChatRenderer(
            o.model, o.req.include_usage, rids=a.rids, token_bytes=o.engine.token_bytes, splitter=a.splitter
        )


class Completions(_OpenAIRoute):
    name = "completions"
    chat = False

    def turn(self, o: Opened) -> Turn:
        o.req = self.checked(o)
        return Turn(text=o.req.prompt)

    def encoder(self, a: Admitted) -> Renderer:
        o = a.opened
        return CompletionRenderer(o.model, o.req.include_usage, rids=a.rids, token_bytes=o.engine.token_bytes)


CHAT = ChatCompletions()
COMPLETIONS = Completions()


async def chat_completions(request: Request, host: Any) -> Response:
    return await road.run_turn(request, host, CHAT)


async def completions(request: Request, host: Any) -> Response:
    return await road.run_turn(request, host, COMPLETIONS)


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", endpoint("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
    ]
