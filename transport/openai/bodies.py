"""OpenAI's response bodies as msgspec Structs: ``chat.completion``, its
stream chunks, ``text_completion``, the model list and the error body (the
requests are in ``transport.openai.schema``)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.types import Usage
from transport.turn import cache_miss


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # Ember's extension: why the prompt missed the cache, only when it diverged
    # from a cached sequence (transport/turn/cache_miss.py)
    cache_miss: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class UsageBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: dict[str, Any] | None = None  # Ember's extension, only when a drafter ran

    @classmethod
    def of(cls, u: Usage) -> UsageBody:
        return cls(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=u.cached_tokens,
                cache_miss=cache_miss.body(u.cache_miss) if u.cache_miss is not None else msgspec.UNSET,
            ),
            speculation=msgspec.to_builtins(u.speculation) if u.speculation is not None else None,
        )


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET  # only when the model called
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # only when a reasoning model reasoned


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class TextLogprobs(msgspec.Struct):
    """A text completion choice's ``logprobs`` (OpenAI's legacy shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody | None
    object: str = "chat.completion"


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """OpenAI's streamed call: the first piece has id, type and name (and empty
    arguments), the rest only ``function.arguments`` pieces, all with ``index``."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageBody | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: TextLogprobs | None = None


class TextCompletion(msgspec.Struct, kw_only=True):
    """Both the response and each stream chunk of /v1/completions (OpenAI uses one shape)."""

    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageBody | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "ember"
    object: str = "model"
    # the model's context window (tokens), once it is loaded: what an agent
    # compacts by (vLLM's max_model_len, LM Studio's/OpenRouter's context_length)
    context_length: int | None = None
    max_model_len: int | None = None
    # the registry's view (ember/registry.py): loaded / loading / available, what it holds
    state: str | None = None
    kind: str | None = None  # "chat" or "embed"
    memory_bytes: int | None = None
    size_bytes: int | None = None
    pinned: bool | None = None
    keep_alive_s: float | None = None
    aliases: list[str] | None = None
    error: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (kind "adapter"; vLLM's card has it too)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
