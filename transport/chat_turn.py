"""What the three chat APIs share once a request is decoded: the prompt (the
model's chat template, offering the tools), the constraint that forces a tool
call, and the splitter that cuts calls out of the output.

Chat Completions (transport/http.py), Anthropic Messages
(transport/anthropic_api.py) and OpenAI Responses (transport/responses_api.py)
each turn their own request shape into OpenAI-style template messages and a
``ToolSetup``, call these, and render the same events their own way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.types import Constraint, SamplingParams
from transport.tool_calls import CallSplitter, markup_of
from transport.tools import ToolSetup


def engine_enforces_constraints(engine: Any) -> bool:
    """Whether this engine masks logits by ``SamplingParams.constraint`` (the MLX
    backend with llguidance does; the fake GPU does not)."""
    return bool(getattr(engine.info, "logits_processing", False))


def chat_prompt(engine: Any, messages: list[dict[str, Any]], setup: ToolSetup, param: str = "messages") -> list[int]:
    """The prompt tokens; a template that cannot render the input is the input's fault (400)."""
    setup.check_markup(markup_of(engine.tokenizer))
    try:
        return engine.chat_prompt(messages, setup.template_tools())
    except InvalidRequest:
        raise
    except Exception as exc:  # a template raises on what it cannot render (roles, order)
        raise InvalidRequest(f"the chat template cannot render these messages: {exc}", param) from None


def with_constraint(engine: Any, params: SamplingParams, constraint: Constraint | None, param: str) -> SamplingParams:
    """``params`` constrained to ``constraint``; refused (400 on ``param``) when the
    engine cannot enforce it or another constraint is already set, never ignored."""
    if constraint is None:
        return params
    if params.constraint is not None:
        raise InvalidRequest("a forced tool call and a response format cannot both constrain the output", param)
    if not engine_enforces_constraints(engine):
        raise InvalidRequest("this engine cannot enforce a grammar (constrained decoding), which this parameter needs", param)
    return msgspec.structs.replace(params, constraint=constraint)


def tool_params(engine: Any, params: SamplingParams, setup: ToolSetup) -> SamplingParams:
    markup = markup_of(engine.tokenizer)
    return with_constraint(engine, params, setup.constraint(markup), setup.param_choice)


def splitter(engine: Any, setup: ToolSetup, id_prefix: str = "call_") -> CallSplitter | None:
    """None when no tools are in play: the text is the answer, verbatim."""
    if not setup.active:
        return None
    names = [t.as_template_tool() for t in setup.tools]
    single = not setup.parallel
    return CallSplitter(markup_of(engine.tokenizer), names, single=single, id_prefix=id_prefix)


async def submit(engine: Any, prompt: list[int], params: SamplingParams, constraint_param: str | None) -> Any:
    """``engine.asubmit``; a grammar the engine cannot compile is reported on the
    request's own parameter (``tool_choice``, ``text.format``), not ``constraint``."""
    try:
        return await engine.asubmit(prompt, params)
    except InvalidRequest as exc:
        if exc.param == "constraint" and constraint_param is not None:
            raise InvalidRequest(str(exc), constraint_param) from None
        raise
