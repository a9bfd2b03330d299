"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests are decoded strictly (``forbid_unknown_fields``): a misspelt or
unsupported field is a 400 naming it, not a silent no-op. Which common OpenAI
fields are accepted is a deliberate list (docs/http.md):

* accepted and ignored, because they do not change the output: ``user``,
  ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``;
* accepted only at their neutral value (anything else is a 400 saying it is
  not supported): ``n`` (1), ``logprobs`` (false / null), ``top_logprobs``,
  ``presence_penalty`` / ``frequency_penalty`` (0), ``logit_bias`` (empty),
  ``response_format`` (``{"type": "text"}``), ``tools`` (empty),
  ``tool_choice`` ("none"), and for completions ``echo`` (false),
  ``best_of`` (1), ``suffix`` (empty);
* Ember's extensions (vLLM / mlx-lm spell them the same way): ``top_k``,
  ``min_p``, ``ignore_eos``, ``num_draft_tokens``, ``speculate``.

Ranges (``max_tokens >= 1``, ``0 < top_p <= 1``, the seed, the context
length, token ids in the vocabulary) are checked once, by the Gateway, so the
embedded API and HTTP agree; the schema checks types and shapes.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.types import SamplingParams, Usage

MAX_STOP_STRINGS = 16
MAX_DRAFT_TOKENS = 64  # a draft window is verified in one forward: beyond this it is only waste
MAX_STOP_CHARS = 256  # the stop matcher holds back up to len(stop)-1 chars and rescans them per token


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The dict a chat template reads; text parts are concatenated like mlx-lm does."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str


class _Common(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool = False
    num_draft_tokens: int | None = None
    speculate: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: they do not change what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequest("n must be 1: Ember generates one choice per request", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequest(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters", "stop")
        if self.num_draft_tokens is not None and not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]", "num_draft_tokens")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's settings; unset fields take the engine defaults (greedy)."""
        d = SamplingParams()
        max_tokens = self.requested_max_tokens()
        top_k = d.top_k if self.top_k is None else self.top_k
        if top_k >= vocab_size:
            top_k = 0  # keeps every token, which is what "no top-k" means; a sampler may choke on k > vocab
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=d.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            num_draft_tokens=self.num_draft_tokens,
            speculate=self.speculate,
        )


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools: ignored

    def check(self) -> ChatCompletionRequest:
        self._check_common()
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        if self.logprobs:
            raise InvalidRequest("logprobs are not supported", "logprobs")
        if self.top_logprobs not in (None, 0):
            raise InvalidRequest("top_logprobs is not supported", "top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequest("only response_format {\"type\": \"text\"} is supported", "response_format")
        if self.tools:
            raise InvalidRequest("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice is not supported", "tool_choice")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> CompletionRequest:
        self._check_common()
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported", "logprobs")
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of must be 1", "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        return self


_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_request(body: bytes, kind: type[ChatCompletionRequest] | type[CompletionRequest]) -> Any:
    """Decode and check a request body; any problem is an ``InvalidRequest``."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _AT_PATH.search(message)
        param = (m.group(1) or None) if m else None
        unknown = _UNKNOWN.search(message)
        if unknown:  # name the field itself, not the object holding it
            param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        raise InvalidRequest(message, param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    return req.check()


# ---------------------------------------------------------------------------
# Responses.


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


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
            prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
            speculation=msgspec.to_builtins(u.speculation) if u.speculation is not None else None,
        )


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody | None
    object: str = "chat.completion"


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
