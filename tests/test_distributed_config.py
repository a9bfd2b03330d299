"""``--distributed`` as a flag: what it turns off and what it refuses, checked
before anything loads (the two-rank engine itself: tests/test_distributed.py)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
from engine.types import SamplingParams
from transport.cli import build_parser, engine_config


def test_the_flag_turns_the_tiers_off_and_arms_the_step_watchdog():
    args = build_parser().parse_args(["serve", "--distributed", "tensor"])
    config = engine_config(args, args.parser)
    assert (config.distributed, config.prompt_cache_gib, config.ssd_cache_dir) == ("tensor", 0.0, None)
    assert config.step_timeout_s and config.step_timeout_s > 0  # a hung rank ends as engine_dead


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--prompt-cache", "1"], "prompt-cache tiers are off in distributed mode"),
        (["--prompt-cache", "1", "--ssd-cache", "/tmp/x"], "prompt-cache tiers are off"),
        (["--draft-model", "ngram"], "speculative decoding is not supported in distributed mode"),
        (["--fake-gpu"], "needs the MLX backend"),
    ],
)
def test_refused_combinations_exit_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        args = build_parser().parse_args(["serve", "--distributed", "pipeline", *flags])
        engine_config(args, args.parser)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_unknown_mode_is_refused():
    with pytest.raises(InvalidRequest, match="tensor or pipeline"):
        EngineConfig(distributed="data", prompt_cache_gib=0).validate()


def test_a_step_plan_survives_the_wire():
    from engine.mlx_distributed import _decode_plan, encode_plan

    plan = StepPlan(
        close=[3],
        keep_cache={3},
        open=[OpenRow(rid=5, sampling=SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=11, stop=["\n"]))],
        trim=[(4, 2)],
        prefill=[PrefillChunk(rid=5, tokens=[1, 2, 3])],
        decode=[DecodeRow(rid=4, token=17)],
    )
    assert _decode_plan(encode_plan(plan)) == plan


def test_a_plan_with_a_prefix_cache_is_never_shared():
    from engine.mlx_distributed import encode_plan

    plan = StepPlan(open=[OpenRow(rid=1, sampling=SamplingParams(), cache=object(), cached=16)])
    with pytest.raises(RuntimeError, match="prefix cache"):
        encode_plan(plan)
