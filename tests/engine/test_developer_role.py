"""OpenAI's developer role reaches a chat template that does not know it as a
system message (engine.mlx.tokenizer.MLXTokenizer._template_roles); a
template that renders the role itself gets it unchanged. The template here
follows Qwen2.5's rule: roles it does not name are dropped, without an error."""

from __future__ import annotations

import pytest
from mlx_lm import load

from engine.mlx.tokenizer import MLXTokenizer
from engine.models import resolve_model

DROPS_UNKNOWN = (
    "{%- for m in messages %}{%- if m.role in ['system', 'user', 'assistant'] %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
NAMES_DEVELOPER = DROPS_UNKNOWN.replace("'assistant']", "'assistant', 'developer']")
DEV = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def wrapper():
    _, tok = load(str(resolve_model("tiny")))
    return tok


def _tok(wrapper, template: str) -> MLXTokenizer:
    wrapper._tokenizer.chat_template = template
    return MLXTokenizer(wrapper)


def test_a_template_that_drops_the_role_gets_a_system_message(wrapper):
    tok = _tok(wrapper, DROPS_UNKNOWN)
    assert "be brief" not in wrapper.apply_chat_template(DEV, add_generation_prompt=True, tokenize=False)
    text = tok.render_chat(DEV)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert tok.apply_chat_template(DEV) == tok.encode_rendered(text)


def test_a_template_that_names_the_role_keeps_it(wrapper):
    tok = _tok(wrapper, NAMES_DEVELOPER)
    assert tok.render_chat(DEV).startswith("<|im_start|>developer\nbe brief<|im_end|>")


def test_messages_without_the_role_are_passed_as_they_are(wrapper):
    tok = _tok(wrapper, DROPS_UNKNOWN)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok._template_roles(msgs) is msgs
