"""What the three chat APIs share once a request is decoded: the prompt (the
model's chat template, offering the tools), the constraint that forces a tool
call, and the splitter that cuts calls out of the output.

Chat Completions (transport/openai/api.py), Anthropic Messages
(transport/anthropic/api.py) and OpenAI Responses (transport/responses/api.py)
each turn their own request shape into OpenAI-style template messages and a
``ToolSetup``; the one road (transport/turn/road.py) calls these for all of
them, and each renders the same events its own way.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import anyio
import msgspec

from ember import Completion, RequestStream
from ember.api import Engine
from engine.errors import EngineError, InvalidRequest
from engine.types import Constraint, SamplingParams
from transport.turn import cache_miss, generic_tools, reasoning
from transport.turn.choices import ChoiceStream
from transport.turn.output_memory import OutputMemory
from transport.turn.tool_calls import CallSplitter, Count, markup_of
from transport.turn.tools import ToolSetup
from transport.wire.metrics import TokenTimer
from transport.wire.request_io import event_stream
from transport.wire.sse import Disconnect


def engine_enforces_constraints(engine: Engine) -> bool:
    """Whether this engine masks logits by ``SamplingParams.constraint`` (the MLX
    backend with llguidance and the scripted model do; the fake GPU does not)."""
    return engine.info.constraints


class Prompt(list):
    """A chat prompt's token ids, with the text they render (None when the
    tokenizer cannot say) and the cache namespace it was made in, for
    ``remember``, and what it was rendered from (the template's messages,
    tools and variables) for naming the message a cache miss falls in
    (transport/turn/cache_miss.py)."""

    text: str | None = None
    ns: str = ""
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None


_MEMORIES: weakref.WeakKeyDictionary[Any, OutputMemory] = weakref.WeakKeyDictionary()


def output_memory(engine: Engine) -> OutputMemory:
    """The engine's memory of generated ids (transport/turn/output_memory.py)."""
    memory = _MEMORIES.get(engine)
    if memory is None:
        # EMBER_OUTPUT_MEMORY=0 keeps nothing: bench.serve.agent_turns --no-output-memory measures without it
        off = os.environ.get("EMBER_OUTPUT_MEMORY", "1") == "0"
        memory = _MEMORIES[engine] = OutputMemory(max_chars=0 if off else 16 << 20)
    return memory


def tool_markup(engine: Engine) -> Any:
    """The markers calls are written in: the template's own, else the generic
    format's (transport/turn/generic_tools.py)."""
    return markup_of(engine.tokenizer) or generic_tools.MARKUP


def thinking_kwargs(host: Any, engine: Engine, route: str, field: str, choice: bool | None) -> dict[str, Any] | None:
    """A request's thinking choice as template variables, counted: ``honoured``
    on a model that reasons, ``ignored`` on one that does not (its template has no switch)."""
    if choice is None:
        return None
    thinks = reasoning.markup_of(engine.tokenizer) is not None
    envelope = getattr(host, "envelope", None)
    if envelope is not None:
        envelope.note(route, field, "honoured" if thinks else "ignored")
    return reasoning.template_kwargs(choice) if thinks else None


def chat_prompt(
    engine: Engine,
    messages: list[dict[str, Any]],
    setup: ToolSetup,
    param: str = "messages",
    template_kwargs: dict[str, Any] | None = None,
    ns: str = "",
) -> Prompt:
    """The prompt tokens — earlier answers as the model generated them, where
    the conversation repeats them (answers made in cache namespace ``ns`` only);
    a template that cannot render the input is the input's fault (400).
    ``template_kwargs`` are extra chat-template variables (``enable_thinking``…)."""
    tok = engine.tokenizer
    setup.check_markup(tool_markup(engine))
    tools = setup.template_tools()
    if generic_tools.applies(markup_of(tok), messages, tools):
        messages, tools = generic_tools.render_messages(messages, tools), None
    try:
        if not hasattr(tok, "render_chat"):
            return Prompt(engine.chat_prompt(messages, tools))
        text = tok.render_chat(messages, tools, **(template_kwargs or {}))
    except InvalidRequest:
        raise
    except Exception as exc:  # a template raises on what it cannot render (roles, order)
        raise InvalidRequest(f"the chat template cannot render these messages: {exc}", param) from None
    ids, _ = output_memory(engine).tokenize(text, tok.encode_rendered, scope=ns)
    prompt = Prompt(ids)
    prompt.text, prompt.ns = text, ns
    prompt.messages, prompt.tools, prompt.template_kwargs = messages, tools, template_kwargs
    return prompt


def remember(engine: Engine, prompt: Prompt, text: str, token_ids: list[int]) -> None:
    """Keep a finished answer's ids for the next turn, if they spell its text exactly."""
    if prompt.text is None or not token_ids or engine.tokenizer.decode(token_ids) != text:
        return
    output_memory(engine).remember(prompt.text + text, list(prompt) + list(token_ids), scope=prompt.ns)


class Recording:
    """A streaming renderer that also hands the whole output to ``on_finish``."""

    def __init__(self, renderer: Any, on_finish: Any):
        self._renderer = renderer
        self._on_finish = on_finish
        self._out: dict[int, tuple[list[str], list[int]]] = {}  # per row (n choices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._renderer, name)

    def delta(self, d: Any) -> list[bytes]:
        text, ids = self._out.setdefault(d.rid, ([], []))
        text.append(d.text)
        ids += d.token_ids
        if d.finish_reason is not None:
            self._on_finish("".join(text), ids)
        return self._renderer.delta(d)


def with_constraint(
    engine: Engine, params: SamplingParams, constraint: Constraint | None, param: str
) -> SamplingParams:
    """``params`` constrained to ``constraint``; refused (400 on ``param``) when the
    engine cannot enforce it or another constraint is already set, never ignored."""
    if constraint is None:
        return params
    if params.constraint is not None:
        raise InvalidRequest("a forced tool call and a response format cannot both constrain the output", param)
    if not engine_enforces_constraints(engine):
        raise InvalidRequest(
            "this engine cannot enforce a grammar (constrained decoding), which this parameter needs", param
        )
    return msgspec.structs.replace(params, constraint=constraint)


def tool_params(engine: Engine, params: SamplingParams, setup: ToolSetup) -> SamplingParams:
    return with_constraint(engine, params, setup.constraint(tool_markup(engine)), setup.param_choice)


def splitter(
    engine: Engine,
    setup: ToolSetup,
    id_prefix: str = "call_",
    prompt: Prompt | None = None,
    count: Count | None = None,
) -> Any:
    """What cuts the output into answer text, tool calls and (for a reasoning
    model, transport/turn/reasoning.py) reasoning; None when there is nothing to cut:
    the text is the answer, verbatim. ``prompt`` says whether the output starts
    inside an open ``<think>``; ``count`` is told of the calls read and those
    that did not parse (the route's ``ToolCallCounter.for_route``)."""
    calls = None
    if setup.active:
        offered = [t.as_template_tool() for t in setup.tools]
        calls = CallSplitter(tool_markup(engine), offered, single=not setup.parallel, id_prefix=id_prefix, count=count)
    thinking = reasoning.markup_of(engine.tokenizer)
    if thinking is None:
        return calls
    inside = reasoning.starts_inside(prompt.text if prompt is not None else None, thinking)
    return reasoning.OutputSplitter(thinking, calls, inside=inside)


async def submit(
    engine: Engine, prompt: list[int], params: SamplingParams, param_names: dict[str, str], ns: str = ""
) -> Any:
    """``engine.asubmit`` in cache namespace ``ns``; an engine error is reported on the request's own
    parameter (``param_names``: ``constraint`` -> ``tool_choice``,
    ``max_tokens`` -> ``max_output_tokens``…), not on the engine's name."""
    try:
        return await engine.asubmit(prompt, params, ns=ns)
    except InvalidRequest as exc:
        if exc.param in param_names:
            raise InvalidRequest(str(exc), param_names[exc.param]) from None
        raise


async def respond(
    request: Any, host: Any, engine: Engine, prompt: list[int], stream: Any, renderer: Any, streaming: bool, timer: Any
) -> Any:
    """Send the answer — SSE or one body — and, for a chat (a ``Prompt``: a
    completion's raw prompt has no template to continue or explain), remember
    its ids for the next turn and explain a cache miss."""
    from starlette.responses import Response

    chat = prompt if isinstance(prompt, Prompt) else None

    def on_finish(text: str, ids: list[int]) -> None:
        if chat is not None:
            remember(engine, chat, text, ids)

    async def on_usage(usage: Any) -> None:
        """A usage reporting a cache miss gets its message and excerpts (off the loop)."""
        if chat is not None and usage is not None and usage.cache_miss is not None:
            await host.off_loop(cache_miss.explain, engine, chat, usage.cache_miss, engine=engine)

    if streaming:
        out = Recording(renderer, on_finish) if chat is not None else renderer
        return event_stream(host, stream, out, timer, on_usage=on_usage if chat is not None else None)
    completion = await collect(stream, request.receive, timer)
    if completion is None:
        return Response(status_code=400)  # the client left; nothing is sent
    for c in completion if isinstance(completion, list) else [completion]:  # n choices: each may be continued
        on_finish(c.text, c.token_ids)
        await on_usage(c.usage)
    return Response(renderer.body(completion), media_type="application/json")


def matched_stop(text: str, token_ids: list[int], stops: list[str], tokenizer: Any) -> str | None:
    """Which stop string ended an output (Anthropic's ``stop_sequence``): the
    engine cuts the text before it, but the tokens that spelled it were generated."""
    if not stops:
        return None
    full = tokenizer.decode(token_ids)
    rest = full[len(text) :] if full.startswith(text) else full
    hits = [s for s in stops if rest.startswith(s)] or [s for s in stops if s in rest]
    return hits[0] if hits else None


async def collect(stream: RequestStream | ChoiceStream, receive: Any, timer: TokenTimer) -> Any:
    """A non-streaming request's whole output (a list, one per choice, for a
    ``ChoiceStream``), or None if the client left (then it is aborted)."""
    rids = getattr(stream, "rids", None)
    outs = {rid: Completion() for rid in rids} if rids else None
    out = Completion()
    disconnect = Disconnect(receive)
    failed: EngineError | None = None
    async with stream, anyio.create_task_group() as tg:
        tg.start_soon(disconnect.cancel_on_disconnect, tg.cancel_scope)
        try:
            async for d in stream:
                timer.tokens(len(d.token_ids), d.usage)
                (outs[d.rid] if outs is not None else out).add(d)
        except EngineError as exc:
            failed = exc
        tg.cancel_scope.cancel()
    if failed is not None:
        raise failed
    if disconnect.happened:
        return None
    timer.done()
    return [outs[rid] for rid in rids] if outs is not None and rids else out
