"""The memory of generated ids: the next turn's prompt starts with the ids the
model sampled, not a re-tokenization of their text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from transport.turn.chat_turn import Prompt, remember
from transport.turn.output_memory import OutputMemory


def encode(text: str) -> list[int]:
    """A 'canonical' tokenizer: one id per character."""
    return [ord(c) for c in text]


def test_a_kept_answer_is_reused_and_only_the_rest_is_tokenized():
    m = OutputMemory()
    # the model spelled "Paris" as two tokens that are not the canonical split
    m.remember("<u>hi</u><a>Paris", encode("<u>hi</u><a>") + [1000, 1001])
    ids, key = m.tokenize("<u>hi</u><a>Paris</a><u>more</u><a>", encode)
    assert key == "<u>hi</u><a>Paris"
    assert ids == encode("<u>hi</u><a>") + [1000, 1001] + encode("</a><u>more</u><a>")
    # a conversation that does not repeat the answer verbatim is tokenized plainly
    ids, key = m.tokenize("<u>hi</u><a>Pari</a>", encode)
    assert key is None and ids == encode("<u>hi</u><a>Pari</a>")
    assert m.stats()["hits"] == 1


def test_the_longest_key_wins_and_the_cap_evicts_the_oldest():
    m = OutputMemory(max_chars=30)
    m.remember("abc", [1])
    m.remember("abcdef", [2])
    assert m.tokenize("abcdefg", encode) == ([2, ord("g")], "abcdef")
    m.remember("x" * 24, [3])  # 3 + 6 + 24 > 30: the least recently used ("abc") goes
    assert len(m) == 2 and m.tokenize("abcz", encode)[1] is None
    m.remember("y" * 31, [4])  # longer than the cap: not kept at all
    assert m.tokenize("y" * 31, encode)[1] is None


def test_remember_keeps_only_ids_that_spell_the_text():
    class Engine:  # the memory is kept per engine, by weak reference
        tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(i) for i in ids))

    engine = Engine()
    prompt = Prompt(encode("P:"))
    prompt.text = "P:"
    remember(engine, prompt, "ok", encode("ok"))
    remember(engine, prompt, "cut", encode("cut STOP"))  # a stop string cut the text short of the ids
    from transport.turn.chat_turn import output_memory

    m = output_memory(engine)
    assert m.tokenize("P:ok!", encode)[1] == "P:ok"
    assert m.tokenize("P:cut!", encode)[1] is None


@pytest.mark.slow
def test_tiny_renders_tools_and_its_text_tokenizes_like_the_template():
    from mlx_lm.tokenizer_utils import load

    from engine.mlx.tokenizer import MLXTokenizer
    from engine.models import resolve_model

    tok = MLXTokenizer(load(resolve_model("tiny")))
    assert tok.tool_markup is not None and tok.tool_markup.json_form  # mlx-lm picked json_tools from the template
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi, Paris!"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "done"},
    ]
    for t in (None, tools):
        text = tok.render_chat(messages, t)
        assert tok.encode_rendered(text) == tok.apply_chat_template(messages, tools=t)
    text = tok.render_chat(messages, tools)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\ndone\n</tool_response>" in text and '"name": "f"' in text.split("<tools>\n")[1]


def test_an_answer_is_reused_only_in_the_scope_it_was_made_in():
    """Under named API keys (issue #44) alice's answers never tokenize bob's
    prompt: his prompt token count would tell that someone had that conversation."""
    m = OutputMemory()
    m.remember("<u>hi</u><a>Paris", encode("<u>hi</u><a>") + [1000, 1001], scope="key:alice")
    text = "<u>hi</u><a>Paris</a>"
    assert m.tokenize(text, encode, scope="key:bob") == (encode(text), None)
    assert m.tokenize(text, encode) == (encode(text), None)  # nor the empty scope
    ids, key = m.tokenize(text, encode, scope="key:alice")
    assert key == "<u>hi</u><a>Paris" and ids[-6:-4] == [1000, 1001]
