"""The fake GPU's tokenizer: bytes are tokens 0..255, EOS is 256, and a
plain-text chat template with Hermes/Qwen-style tool calls."""

from __future__ import annotations

import codecs
import json
from typing import Any

from engine.tool_markup import ReasoningMarkup, ToolMarkup


class ByteDetokenizer:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._segment = ""
        self._pending = False  # the decoder holds the first bytes of a sequence

    def add_token(self, token: int) -> None:
        if token < 128 and not self._pending:  # what the decoder gives an ASCII byte with nothing held
            self._segment = chr(token)
        elif not self._pending and (token < 0xC2 or 0xF5 <= token < 256):
            # a byte that cannot start a sequence (a lone continuation byte,
            # an overlong or out-of-range lead), with nothing held: the
            # decoder replaces it and still holds nothing
            self._segment = "\ufffd"
        elif token < 256:
            self._segment = self._dec.decode(bytes([token]))
            self._pending = bool(self._dec.getstate()[0])
        else:
            self._segment = ""

    def finalize(self) -> None:
        self._segment = self._dec.decode(b"", final=True)
        self._pending = False

    @property
    def last_segment(self) -> str:
        seg, self._segment = self._segment, ""
        return seg


def _parse_json_call(text: str, tools: Any = None) -> Any:
    """mlx-lm's `json_tools` parser, without importing mlx-lm."""
    return json.loads(text.strip())


class ByteTokenizer:
    EOS = 256
    vocab_size = 260
    reasoning_markup: ReasoningMarkup | None = None  # it does not think (a script may say it does)

    def __init__(self) -> None:
        self.eos_token_ids = {self.EOS}
        self.tool_markup = ToolMarkup(start="<tool_call>", end="</tool_call>", parser=_parse_json_call, json_form=True)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools))

    def encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        # template variables (enable_thinking…) change nothing in the fake's fixed format
        text = f"<|tools|>{json.dumps(tools)}\n" if tools else ""
        for m in messages:
            text += f"<|{m['role']}|>{m.get('content') or ''}"
            for call in m.get("tool_calls") or []:  # the Hermes/Qwen form, like the bundled tiny template
                fn = call.get("function", call)
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
            text += "\n"
        return text + "<|assistant|>" if generation_prompt else text
