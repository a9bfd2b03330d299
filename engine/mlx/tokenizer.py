"""The ``engine.ports.Tokenizer`` port over mlx-lm's ``TokenizerWrapper``.

Nothing here touches MLX arrays, so these methods are safe on the event loop
(the Scheduler makes a detokenizer per request there).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest
from engine.tool_markup import ReasoningMarkup, ToolMarkup  # re-exported: they lived here


class MLXTokenizer:
    def __init__(self, wrapper: Any):
        self._tok = wrapper
        self.eos_token_ids: set[int] = set(wrapper.eos_token_ids)
        self._bos: str | None = getattr(wrapper, "bos_token", None)
        self.tool_markup = _tool_markup(wrapper)
        self.reasoning_markup = _reasoning_markup(wrapper)
        template = getattr(wrapper, "chat_template", None)
        text = template if isinstance(template, str) else " ".join(str(v) for v in (template or {}).values())
        self._knows_developer = "developer" in text  # does the chat template render the developer role?

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        # The same rule as mlx_lm.stream_generate, so a text prompt becomes the
        # same ids in the engine as in mlx-lm: no second BOS when it is spelled out.
        add_special = self._bos is None or not text.startswith(self._bos)
        return list(self._tok.encode(text, add_special_tokens=add_special))

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(tokens)

    def detokenizer(self) -> Any:
        # mlx-lm's property hands out a reset copy per caller: one per request.
        # It already has add_token / finalize / last_segment.
        return self._tok.detokenizer

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text; ``encode_rendered`` of it equals ``apply_chat_template``.
        ``template_kwargs`` are extra template variables (``enable_thinking``…);
        without ``generation_prompt``, the messages alone (where each one ends)."""
        if not self._tok.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a plain prompt", "messages")
        if tools and self.tool_markup is None:
            raise InvalidRequest("this model's chat template does not support tools", "tools")
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        kw.update(template_kwargs)
        messages = self._template_roles(messages)
        try:
            return self._tok.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **kw
            )
        except Exception as exc:  # jinja errors on malformed messages: the caller's fault
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from exc

    def _template_roles(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI's ``developer`` role is its system role for its own models
        (Codex sends its whole system prompt as developer messages). A template
        that never names the role drops such a message without a word:
        Qwen2.5's renders only user, system, assistant and tool, so Codex's
        instructions never reached the model. There it becomes ``system``."""
        if self._knows_developer or not any(m.get("role") == "developer" for m in messages):
            return messages
        return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]

    def encode_rendered(self, text: str) -> list[int]:
        """Tokens of template output: its special tokens are spelled out, none are added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        if not self._tok.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a plain prompt", "messages")
        if tools and self.tool_markup is None:
            raise InvalidRequest("this model's chat template does not support tools", "tools")
        kw = {"tools": tools} if tools else {}
        messages = self._template_roles(messages)
        try:
            out = self._tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
        except Exception as exc:  # jinja errors on malformed messages: the caller's fault
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from exc
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # a BatchEncoding from some templates
            out = out["input_ids"]
        return [int(t) for t in out]


def _reasoning_markup(wrapper: Any) -> ReasoningMarkup | None:
    """mlx-lm's thinking markers for this tokenizer (``<think>``/``</think>``…), None: it does not think."""
    if not getattr(wrapper, "has_thinking", False):
        return None
    return ReasoningMarkup(start=wrapper.think_start, end=wrapper.think_end)


def _tool_markup(wrapper: Any) -> Any:
    """mlx-lm's tool-call markers and parser for this template (None: no tools)."""
    if not getattr(wrapper, "has_tool_calling", False):
        return None
    parser = wrapper.tool_parser
    return ToolMarkup(
        start=wrapper.tool_call_start,
        end=wrapper.tool_call_end,
        parser=parser,
        json_form=getattr(parser, "__module__", "") == "mlx_lm.tool_parsers.json_tools",
    )
