"""The scripted test model: the fake GPU with a real tokenizer and replies given per turn.

An agent client (Claude Code, Codex CLI, OpenCode) needs a model that calls a
tool on cue, reads the result and answers; a random-weight model does not, and
a real one is slow and unpredictable. This backend is the fake GPU
(``engine.fake.gpu``: caches that are real arrays, trimmed, spilled and
restored like MLX caches; a forward that costs nothing) whose next token is
not drawn from hashed logits but read from a *script*: the reply the script
gives for the conversation in the row's cache, tokenized with a real Hugging
Face tokenizer (by default the bundled ``tiny`` model's, whose ChatML/Hermes
template renders tools and whose ``<tool_call>`` markup mlx-lm's ``json_tools``
parser reads back). Everything above the forward is the real thing: the HTTP
routes, the chat template, the tool parser, the Gateway, the Scheduler's
batching and the prompt-cache tiers. A 30k-token prompt prefills in well under
a second.

The script (a JSON file)::

    {
      "context_length": 262144,          # optional (default 262144)
      "tokenizer": "tiny",               # optional: a bundled model name or an mlx-lm model directory
      "rules": [                         # the first rule that matches the conversation answers it
        {"tools": true, "tool_results": 0,
         "tool_calls": [{"name": "Bash", "arguments": {"command": "cat note.txt"}}]},
        {"tools": true, "min_tool_results": 1, "text": "The file says: {{tool_result}}"}
      ],
      "default": "OK."                   # when no rule matches
    }

A rule's conditions, all optional, all of which must hold:

``tool_results`` / ``min_tool_results`` / ``max_tool_results``
    the number of tool results in the prompt (``<tool_response>`` blocks of the template);
``tools``
    whether the request offered tools (the template's ``<tools>`` block);
``last_user``
    a regular expression searched in the last user turn's text;
``prompt``
    a regular expression searched in the whole rendered prompt.

Its reply is ``text`` followed by ``tool_calls`` written in the template's tool
markup (``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``), then EOS.
In the text and in string arguments, ``{{tool_result}}`` is the last tool
result's content, ``{{n}}`` the number of tool results so far and
``{{last_user}}`` the last user turn (first 200 characters).

Where a reply starts: after the last ``<|im_start|>assistant\\n`` (the
template's generation prompt) in the row's tokens, so the backend keeps no
per-request state and a row restored from the prompt cache continues the
same reply. A prompt without that marker (a plain completion) gets EOS at once.
Sampling settings are ignored: the script is the model, a distribution with
all its mass on the script's next token. A grammar (``SamplingParams.constraint``:
a forced tool call, a JSON schema, ``json_object``) masks it as it masks any
model, with the same llguidance matchers the MLX backend uses: the script's
token where the grammar allows it, else EOS where the grammar may end, else
the lowest token it allows. A script written to its grammar is answered as
written; one that is not comes out as the grammar bends it, never outside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

from engine.fake.gpu import FakeBackend, FakeGPUConfig, _Row
from engine.mlx.grammar import Grammars
from engine.ports import ModelInfo

DEFAULT_CONTEXT = 262_144
GENERATION_PROMPT = "<|im_start|>assistant\n"
_TOOL_RESULT = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)
_USER_TURN = "<|im_start|>user\n"
_TURN_END = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class Rule:
    text: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    tools: bool | None = None
    tool_results: int | None = None
    min_tool_results: int | None = None
    max_tool_results: int | None = None
    last_user: re.Pattern[str] | None = None
    prompt: re.Pattern[str] | None = None

    def matches(self, conv: Conversation) -> bool:
        n = len(conv.tool_results)
        return (
            (self.tools is None or self.tools == conv.has_tools)
            and (self.tool_results is None or n == self.tool_results)
            and (self.min_tool_results is None or n >= self.min_tool_results)
            and (self.max_tool_results is None or n <= self.max_tool_results)
            and (self.last_user is None or self.last_user.search(conv.last_user) is not None)
            and (self.prompt is None or self.prompt.search(conv.text) is not None)
        )


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What the rules read from a rendered prompt."""

    text: str
    has_tools: bool
    tool_results: list[str]
    last_user: str

    @classmethod
    def of(cls, text: str) -> Conversation:
        start = text.rfind(_USER_TURN)
        last_user = ""
        if start >= 0:
            body = text[start + len(_USER_TURN) :]
            end = body.find(_TURN_END)
            last_user = body if end < 0 else body[:end]
        return cls(text, "<tools>" in text, _TOOL_RESULT.findall(text), last_user)


_RULE_KEYS = {f.name for f in dataclasses.fields(Rule)}


class Script:
    """The rules and the default reply of a script file."""

    def __init__(self, spec: dict[str, Any]):
        if not isinstance(spec, dict):
            raise ValueError("a script is an object with 'rules' (and optionally 'default')")
        unknown = set(spec) - {"rules", "default", "context_length", "tokenizer"}
        if unknown:
            raise ValueError(f"unknown script keys: {sorted(unknown)}")
        self.context_length = int(spec.get("context_length", DEFAULT_CONTEXT))
        self.tokenizer = str(spec.get("tokenizer", "tiny"))
        self.default = str(spec.get("default", "OK."))
        self.rules = [self._rule(i, r) for i, r in enumerate(spec.get("rules", []))]

    @staticmethod
    def _rule(i: int, r: Any) -> Rule:
        if not isinstance(r, dict) or set(r) - _RULE_KEYS:
            raise ValueError(f"rule {i}: an object with keys among {sorted(_RULE_KEYS)}")
        kw = dict(r)
        for key in ("last_user", "prompt"):
            if kw.get(key) is not None:
                kw[key] = re.compile(kw[key], re.S)
        calls = kw.get("tool_calls") or ()
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"rule {i}: each tool call is {{'name': str, 'arguments': object}}")
        kw["tool_calls"] = tuple(calls)
        return Rule(**kw)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Script:
        raw = pathlib.Path(path).read_text(encoding="utf-8")
        return cls(json.loads(raw))

    def reply(self, prompt: str, call_markup: tuple[str, str] = ("<tool_call>", "</tool_call>")) -> str:
        """The reply text (tool calls in ``call_markup``) for a rendered prompt."""
        conv = Conversation.of(prompt)
        values = {
            "{{tool_result}}": conv.tool_results[-1].strip() if conv.tool_results else "",
            "{{n}}": str(len(conv.tool_results)),
            "{{last_user}}": conv.last_user.strip()[:200],
        }

        def fill(s: str) -> str:
            for key, value in values.items():
                s = s.replace(key, value)
            return s

        for rule in self.rules:
            if rule.matches(conv):
                out = fill(rule.text)
                start, end = call_markup
                for call in rule.tool_calls:
                    args = _fill_args(call.get("arguments") or {}, fill)
                    body = json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False)
                    out += ("\n" if out else "") + f"{start}\n{body}\n{end}"
                return out
        return fill(self.default)


def _fill_args(value: Any, fill: Any) -> Any:
    if isinstance(value, str):
        return fill(value)
    if isinstance(value, dict):
        return {k: _fill_args(v, fill) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_args(v, fill) for v in value]
    return value


def _load_tokenizer(name: str) -> Any:
    """The ``engine.ports.Tokenizer`` of a bundled model or an mlx-lm directory
    (mlx-lm's ``TokenizerWrapper``: its template and tool parser)."""
    from mlx_lm.tokenizer_utils import load

    from engine.mlx.tokenizer import MLXTokenizer
    from engine.models import resolve_model

    return MLXTokenizer(load(resolve_model(name)))


# the fake GPU's costs, near zero: the forward is the script (a tiny decode cost
# keeps the loop turning between steps; InlineDevice runs a step inline)
_COSTS = {"prefill_a": 0.0, "prefill_b": 0.0, "decode_c": 1e-4, "decode_d": 0.0, "verify_b": 0.0}


class ScriptedBackend(FakeBackend):
    """``engine.ports.Backend``: the fake GPU's caches, a real tokenizer, the script's tokens."""

    def __init__(self, script_path: str | pathlib.Path, cfg: FakeGPUConfig = FakeGPUConfig()):
        self.script = Script.load(script_path)
        super().__init__(msgspec.structs.replace(cfg, context_length=self.script.context_length, **_COSTS))
        tok = _load_tokenizer(self.script.tokenizer)
        self.tokenizer = tok
        markup = tok.tool_markup
        self._markup = (markup.start, markup.end) if markup is not None else ("<tool_call>", "</tool_call>")
        self._gen = self.tokenizer.encode_rendered(GENERATION_PROMPT)
        self._eos = min(self.tokenizer.eos_token_ids)
        raw = pathlib.Path(script_path).read_bytes()
        fp = hashlib.blake2b(raw + self.script.tokenizer.encode(), digest_size=8).hexdigest()
        self.info = ModelInfo(
            model_id="scripted",
            vocab_size=len(tok),
            context_length=self.script.context_length,
            config_fingerprint=f"scripted-{fp}",
            tokenizer_hash=f"scripted-{self.script.tokenizer}",
            num_layers=self.cfg.num_layers,
            constraints=True,
        )
        # the HF tokenizer under mlx-lm's wrapper, as the MLX backend builds its Grammars
        wrapper = getattr(tok, "_tok", tok)
        self._grammars = Grammars(getattr(wrapper, "_tokenizer", wrapper), len(tok), sorted(tok.eos_token_ids))
        self.grammars = self._grammars  # what ember.api compiles a request's constraint with
        # reply tokens by (prompt length, prefix hash there): decoding a 50k-token
        # prompt per generated token would cost more than the whole engine step
        self._replies: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    def _next(self, row: _Row, h: int) -> int:
        last = row.cache[-1]
        tokens = last.keys[0, 0, : last.offset, 0].astype(np.int64)
        start = self._reply_start(tokens)
        if start is None:
            return self._eos
        key = (start, int(last.values[0, 0, start - 1, 0]))
        reply = self._replies.get(key)
        if reply is None:
            prompt = self.tokenizer.decode(tokens[:start].tolist())
            reply = self.tokenizer.encode_rendered(self.script.reply(prompt, self._markup)) + [self._eos]
            self._replies[key] = reply
            while len(self._replies) > 64:
                self._replies.popitem(last=False)
        else:
            self._replies.move_to_end(key)
        k = len(tokens) - start
        token = reply[k] if k < len(reply) else self._eos
        constraint = row.sampling.constraint
        return token if constraint is None else self._masked(constraint, tokens[start:].tolist(), token)

    def _masked(self, constraint: Any, generated: list[int], token: int) -> int:
        """``token`` under the grammar, after ``generated``. Stateless (the matcher is
        replayed over the reply so far), so a trimmed verify window or a row restored
        from the prompt cache needs no matcher state of its own."""
        import llguidance.numpy as llnp

        matcher = self._grammars.matcher(constraint)
        if matcher.consume_tokens(generated) is False or matcher.is_stopped():
            return self._eos
        if matcher.validate_tokens([token]) == 1:
            return token
        if matcher.is_accepting():
            return self._eos
        mask = llnp.allocate_token_bitmask(1, self._grammars.vocab_size)
        llnp.fill_next_token_bitmask(matcher, mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self._grammars.vocab_size]
        allowed = np.flatnonzero(bits)
        return int(allowed[0]) if len(allowed) else self._eos

    def _reply_start(self, tokens: np.ndarray) -> int | None:
        """The position after the last generation prompt in ``tokens``."""
        gen = self._gen
        n = len(gen)
        # search backwards for the marker's first token, then compare the rest
        candidates = np.flatnonzero(tokens == gen[0])
        for i in candidates[::-1]:
            i = int(i)
            if tokens[i : i + n].tolist() == gen:
                return i + n
        return None
