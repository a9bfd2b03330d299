"""The OpenAI chat completions and completions routes: decode the request
(``schema``), build the prompt and admit it on the shared road
(``transport.turn``), and encode the answer (``render``). ``host`` is the
server's ``ServerState`` (transport.server.http), which mounts ``routes()``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from transport.openai.gateway_compat import request_type, requested_model
from transport.openai.render import ChatRenderer, CompletionRenderer
from transport.turn import chat_turn, reasoning
from transport.turn.chat_turn import collect
from transport.turn.choices import ChoiceStream, submit_choices
from transport.turn.decode import decode_request
from transport.wire.limits import output_limit
from transport.wire.metrics import TokenTimer
from transport.wire.request_io import endpoint, event_stream, read_body, request_namespace


async def _generate(request: Request, host: Any, chat: bool) -> Response:
    host.require_engine()
    body = await read_body(request, host.max_body_bytes)
    req = decode_request(body, request_type(chat, host.trust_gateway))
    ns = request_namespace(request, host.adapter_id(requested_model(req)))
    engine, model = await host.engine_for(requested_model(req), keep_alive=req.keep_alive)
    timer = TokenTimer(host.metrics, engine.clock.now, model)
    thinks = reasoning.markup_of(engine.tokenizer) is not None
    req = host.extensions.check(req, host.envelope, "chat" if chat else "completions", thinks)
    prompt: Any  # a chat_turn.Prompt for a chat, token ids otherwise
    if chat:
        tools = req.tool_setup()
        field = "chat_template_kwargs" if "enable_thinking" in (req.chat_template_kwargs or {}) else "reasoning_effort"
        thinking = chat_turn.thinking_kwargs(host, engine, "chat", field, req.thinking_choice())
        messages = [m.as_template_message() for m in req.messages]
        prompt = await host.chat_prompt(engine, messages, tools, template_kwargs=thinking, ns=ns)
    else:
        if isinstance(req.prompt, str):
            host.check_prompt_bytes([req.prompt], "prompt", engine)
            prompt = await host.off_loop(engine.encode, req.prompt, engine=engine)
        else:
            prompt = engine.encode(req.prompt)
    limit = output_limit(req.requested_max_tokens(), len(prompt), engine.info.context_length, host.default_max_tokens)
    params = req.sampling_params(limit, engine.info.vocab_size)
    rename = req.param_names()
    if chat:
        params = chat_turn.tool_params(engine, params, tools)
        if tools.forced:
            rename["constraint"] = tools.param_choice
    stream = await submit_choices(engine, prompt, req.choice_params(params), rename, ns)
    rids = stream.rids if isinstance(stream, ChoiceStream) else [stream.rid]
    if chat:
        counts = host.metrics.tool_calls.for_route("chat")
        renderer = ChatRenderer(
            model,
            req.include_usage,
            rids=rids,
            token_bytes=engine.token_bytes,
            splitter=lambda: chat_turn.splitter(engine, tools, prompt=prompt, count=counts),
        )
        return await chat_turn.respond(request, host, engine, prompt, stream, renderer, req.stream, timer)
    completion_renderer = CompletionRenderer(model, req.include_usage, rids=rids, token_bytes=engine.token_bytes)
    if req.stream:
        return event_stream(host, stream, completion_renderer, timer)
    completion = await collect(stream, request.receive, timer)
    if completion is None:
        return Response(status_code=400)  # the client left; nothing is sent
    return Response(completion_renderer.body(completion), media_type="application/json")


async def chat_completions(request: Request, host: Any) -> Response:
    return await _generate(request, host, chat=True)


async def completions(request: Request, host: Any) -> Response:
    return await _generate(request, host, chat=False)


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", endpoint("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
    ]
