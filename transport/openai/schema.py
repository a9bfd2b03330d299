"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests are decoded strictly (``forbid_unknown_fields``): a misspelt or
unsupported field is a 400 naming it, not a silent no-op. Which common OpenAI
fields are accepted is a deliberate list (docs/http.md):

* accepted and ignored, because they do not change the output: ``user``,
  ``metadata``, ``store``, ``service_tier``;
* chat's ``prompt_cache_key``: the prompt cache's session key (the RAM tier
  keeps a live session's prefix longest, ``engine.kv.prompt_cache``);
* chat tools: ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
  ``tool_calls`` and ``tool`` messages (checked here and in transport/turn/tools.py);
* accepted only at their neutral value (anything else is a 400 saying it is
  not supported): for completions ``echo`` (false), ``best_of`` (1),
  ``suffix`` (empty);
* logits processing (docs/structured-output.md): ``response_format``
  (``text``, ``json_object``, ``json_schema``, enforced by grammar-constrained
  decoding), ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs: N``
  (completions), both 0..20, ``presence_penalty`` / ``frequency_penalty`` (-2..2),
  ``logit_bias`` (token-id keys, -100..100), ``n`` (1..16 choices);
* Ember's extensions (vLLM / mlx-lm spell them the same way): ``top_k``,
  ``min_p``, ``ignore_eos``, ``num_draft_tokens``, ``speculate``,
  ``repetition_penalty``.

Ranges and defaults (``max_tokens >= 1``, ``0 < top_p <= 1``, penalties,
``logit_bias`` values, stop strings, ``num_draft_tokens``, the seed, the
context length, token ids in the vocabulary) are ``engine.limits``'s, checked
once, by the Gateway, so every entry point agrees; the schema checks types and
shapes, and ``param_names`` says how this API spells the engine's fields.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.limits import MAX_CHOICES
from engine.types import Constraint, SamplingParams
from transport.turn.tools import ToolChoice, ToolSetup, check_tool, template_arguments

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


# The chat-template variables a request may set (``chat_template_kwargs``), with
# their types: a variable the templates Ember knows read. Anything else is a 400.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: a reasoning model's thinking, sent back

    def as_template_message(self) -> dict[str, Any]:
        """The dict a chat template reads; text parts are concatenated like mlx-lm does,
        and a call's arguments are handed over as an object (templates `tojson` them)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:  # a reasoning template (Qwen3) renders or drops it, its choice
            msg["reasoning_content"] = self.reasoning_content
        return msg


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema must compile; a forced call's arguments follow it (always, strict or not)


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        """The grammar this format asks for (None for plain text). ``strict`` is
        honoured either way: the output is always constrained to the schema."""
        if self.type == "text":
            if self.json_schema is not None:
                raise InvalidRequest("json_schema is only allowed with type json_schema", "response_format.json_schema")
            return None
        if self.type == "json_object":
            if self.json_schema is not None:
                raise InvalidRequest("json_schema is only allowed with type json_schema", "response_format.json_schema")
            return Constraint(kind="json_object")
        js = self.json_schema
        if js is None:
            raise InvalidRequest(
                "response_format of type json_schema needs a json_schema", "response_format.json_schema"
            )
        if not _SCHEMA_NAME.match(js.name):
            raise InvalidRequest(
                "json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -", "response_format.json_schema.name"
            )
        if js.schema is None:
            return Constraint(kind="json_object")
        return Constraint(kind="json_schema", source=msgspec.json.encode(js.schema).decode())


class _Common(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or "5m"; negative: never unload (ember/registry.py)
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
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: they do not change what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def _check_common(self) -> None:
        """Shapes only: the ranges are the engine's (``engine.limits``)."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}]", "n")
        self.logit_bias_ids()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")

    def param_names(self) -> dict[str, str]:
        """The engine's names for fields this request spells differently."""
        return {"constraint": "response_format"}

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with its keys as token ids (OpenAI sends them as strings)."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidRequest(f"logit_bias keys must be token ids, not {key!r}", "logit_bias")
            out[int(key)] = float(bias)
        return out

    def logprobs_k(self) -> int | None:
        """Top alternatives per token asked for (None: no logprobs)."""
        return None

    def constraint(self) -> Constraint | None:
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def cache_session(self) -> str | None:
        """The prompt cache's session key (chat's ``prompt_cache_key``)."""
        return None

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's settings; unset fields take the engine defaults (greedy).
        ``max_tokens`` is the output limit resolved against the context
        (``transport.wire.limits.output_limit`` of ``requested_max_tokens()``)."""
        d = SamplingParams()
        top_k = d.top_k if self.top_k is None else self.top_k
        if top_k >= vocab_size:
            top_k = 0  # keeps every token, which is what "no top-k" means; a sampler may choke on k > vocab
        bias = self.logit_bias_ids()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=d.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            num_draft_tokens=self.num_draft_tokens,
            speculate=self.speculate,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            logprobs=self.logprobs_k(),
            constraint=self.constraint(),
            cache_session=self.cache_session(),
        )

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per choice (``n``): each draws its own random stream
        (a request seed ``s`` gives choice ``i`` the seed ``s + i``)."""
        n = self.n or 1
        if n == 1:
            return [params]
        if params.seed is None:
            return [params] * n  # the engine derives each row's seed from its own id
        return [msgspec.structs.replace(params, seed=(params.seed + i) % (1 << 64)) for i in range(n)]


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # OpenAI's chat takes it as Responses does: a session key

    def cache_session(self) -> str | None:
        return self.prompt_cache_key

    def check(self) -> ChatCompletionRequest:
        self._check_common()
        for key, value in (self.chat_template_kwargs or {}).items():
            kind = CHAT_TEMPLATE_KWARGS.get(key)
            if kind is None:
                known = ", ".join(sorted(CHAT_TEMPLATE_KWARGS))
                raise InvalidRequest(f"unknown chat template variable (known: {known})", f"chat_template_kwargs.{key}")
            if not isinstance(value, kind):
                raise InvalidRequest(f"must be a {kind.__name__}", f"chat_template_kwargs.{key}")
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if self.response_format is not None:
            self.response_format.constraint()  # its own shape errors, before any work
        self._check_messages()
        return self

    def _check_messages(self) -> None:
        """Roles and tool traffic that a template would render silently wrong."""
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise InvalidRequest("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            for c in m.tool_calls or []:
                calls.add(c.id)
            if m.role == "tool":
                if m.tool_call_id is None:
                    raise InvalidRequest("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
                if m.tool_call_id not in calls:
                    raise InvalidRequest(
                        f"tool_call_id {m.tool_call_id!r} matches no earlier assistant tool call",
                        f"messages[{i}].tool_call_id",
                    )
            elif m.tool_call_id is not None:
                raise InvalidRequest("only tool messages carry tool_call_id", f"messages[{i}].tool_call_id")

    def tool_setup(self) -> ToolSetup:
        """The checked tools and choice (``tool_choice: none`` offers none)."""
        tools = [
            check_tool(
                t.function.name,
                t.function.description,
                t.function.parameters,
                f"tools[{i}].function",
                strict=bool(t.function.strict),
            )
            for i, t in enumerate(self.tools or [])
        ]
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            choice = ToolChoice(mode="named", name=c.function.name)
        else:
            choice = ToolChoice(mode=c or "auto")
        return ToolSetup.of(tools, choice, self.parallel_tool_calls, "tool_choice")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def thinking_choice(self) -> bool | None:
        """Reasoning on (True), off (False) or the template's default (None):
        ``chat_template_kwargs.enable_thinking`` first, then ``reasoning_effort: "none"``
        (an effort level is not a switch a local template has: it leaves the default)."""
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            return bool(kwargs["enable_thinking"])
        return False if self.reasoning_effort == "none" else None

    def param_names(self) -> dict[str, str]:
        names = {"constraint": "response_format"}
        if self.top_logprobs:  # the engine's ``logprobs`` is the number of alternatives
            names["logprobs"] = "top_logprobs"
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def constraint(self) -> Constraint | None:
        return self.response_format.constraint() if self.response_format is not None else None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> CompletionRequest:
        self._check_common()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of must be 1", "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs
