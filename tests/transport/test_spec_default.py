"""``ember serve`` speculates with prompt lookup by default (issue #32): adaptive
γ drafts only where a request's own text copies its context, so it never costs
plain decode more than 2% (tests/ember/test_spec_isolated.py; the real-model
verdict: docs/bench/spec-default.md). ``--draft-model none`` turns it off;
``generate``, the embedded Engine and the test doubles keep it off."""

from __future__ import annotations

import pytest

from ember import EngineConfig
from ember.registry import Registry
from transport.cli import build_parser, engine_config


def config_of(*argv: str):
    args = build_parser().parse_args(list(argv))
    return engine_config(args, args.parser), args


def test_serve_drafts_with_prompt_lookup_unless_told_otherwise():
    config, args = config_of("serve", "--model", "tiny", "--no-ssd-cache")
    assert (config.draft_model, config.num_draft_tokens) == ("ngram", None)
    assert "prompt lookup" in args.spec_note
    config, _ = config_of("serve", "--model", "tiny", "--no-ssd-cache", "--draft-model", "none")
    assert config.draft_model is None
    config, _ = config_of("serve", "--model", "tiny", "--no-ssd-cache", "--draft-model", "ngram:2:6")
    assert config.draft_model == "ngram:2:6"
    config, _ = config_of("serve", "--model", "tiny", "--no-ssd-cache", "--num-draft-tokens", "3")
    assert (config.draft_model, config.num_draft_tokens) == ("ngram", 3)


@pytest.mark.parametrize(
    "argv",
    [
        ("generate", "--model", "tiny", "--prompt", "hi"),  # one-shot: off unless asked
        ("serve", "--fake-gpu", "--no-ssd-cache"),  # the test double: off unless asked
    ],
)
def test_elsewhere_speculation_stays_off_unless_asked(argv):
    config, _ = config_of(*argv)
    assert config.draft_model is None
    assert EngineConfig().draft_model is None  # the embedded Engine


def test_models_loaded_on_demand_keep_prompt_lookup_but_not_a_draft_model():
    base = EngineConfig(model="tiny", draft_model="ngram", num_draft_tokens=3, prompt_cache_gib=0)
    reg = Registry(base, default="tiny")
    side = [e for e in reg.entries.values() if e.name != "tiny" and e.kind == "chat"]
    assert side, "the bundled models are known to the registry"
    assert all((e.config.draft_model, e.config.num_draft_tokens) == ("ngram", 3) for e in side)
    reg = Registry(EngineConfig(model="tiny", draft_model="tiny-draft", num_draft_tokens=3), default="tiny")
    side = [e for e in reg.entries.values() if e.name != "tiny" and e.kind == "chat"]
    assert all((e.config.draft_model, e.config.num_draft_tokens) == (None, None) for e in side)


def test_serve_bounds_the_prefill_beside_decoding_rows_unless_told_otherwise():
    config, _ = config_of("serve", "--fake-gpu", "--no-ssd-cache")
    assert config.prefill_share == 0.5  # docs/bench/itl-prefill.md
    config, _ = config_of("serve", "--fake-gpu", "--no-ssd-cache", "--prefill-share", "0.25")
    assert config.prefill_share == 0.25
    config, _ = config_of("serve", "--fake-gpu", "--no-ssd-cache", "--prefill-share", "0")
    assert config.prefill_share is None  # the full chunk every step
    config, _ = config_of("generate", "--fake-gpu", "--prompt", "hi")
    assert config.prefill_share is None and EngineConfig().prefill_share is None
