"""``--distributed`` as a flag: what it turns off and what it refuses, checked
before anything loads (the two-rank engine itself: tests/sims/test_distributed.py)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
from engine.types import SamplingParams
from transport.cli import build_parser, engine_config


def test_the_flag_keeps_the_ram_tier_and_arms_the_step_watchdog():
    args = build_parser().parse_args(["serve", "--distributed", "tensor", "--prompt-cache", "1"])
    config = engine_config(args, args.parser)
    assert (config.distributed, config.prompt_cache_gib, config.ssd_cache_dir) == ("tensor", 1.0, None)
    assert config.step_timeout_s and config.step_timeout_s > 0  # a hung rank ends as engine_dead


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--ssd-cache", "/tmp/x"], "SSD cache tier is not supported in distributed mode"),
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
        EngineConfig(distributed="data").validate()


def test_a_step_plan_survives_the_wire():
    from engine.mlx.backend import CachePrefix
    from engine.mlx.distributed import TrackedCache, _decode_wire, encode_wire

    shared = TrackedCache(["layer0", "layer1"])
    shared.origin = 2

    plan = StepPlan(
        close=[3],
        keep_cache={3},
        open=[
            OpenRow(rid=5, sampling=SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=11, stop=["\n"])),
            OpenRow(rid=6, sampling=SamplingParams(), cache=CachePrefix(shared, 16), cached=16),
        ],
        trim=[(4, 2)],
        prefill=[PrefillChunk(rid=5, tokens=[1, 2, 3])],
        decode=[DecodeRow(rid=4, token=17)],
    )
    got, drops = _decode_wire(encode_wire(plan, [1, 0]))
    assert drops == [1, 0]
    assert got.open[1].cache == 2 and got.open[1].cached == 16  # the cache goes by its name
    got.open[1].cache = plan.open[1].cache
    assert got == plan


def test_a_cache_the_other_ranks_do_not_hold_is_never_shared():
    from engine.mlx.distributed import encode_wire

    plan = StepPlan(open=[OpenRow(rid=1, sampling=SamplingParams(), cache=[object()], cached=16)])
    with pytest.raises(RuntimeError, match="do not hold"):
        encode_wire(plan, [])


class _Link:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class _Inner:
    """Closes every row it is told to, keeping its cache: what MLXBackend hands back."""

    def step(self, plan: StepPlan) -> Any:
        from engine.ports import StepResult

        res = StepResult()
        for rid in plan.close:
            if rid in plan.keep_cache:
                res.closed[rid] = [f"kv-of-{rid}"]
        return res


def test_rank0_names_the_caches_it_keeps_and_tells_when_it_drops_them():
    import gc

    from engine.mlx.backend import CachePrefix
    from engine.mlx.distributed import LeaderBackend, TrackedCache, _decode_wire

    link = _Link()
    leader = LeaderBackend(_Inner(), link)  # type: ignore[arg-type]
    res = leader.step(StepPlan(close=[7, 8], keep_cache={7, 8}))
    kept = res.closed
    assert all(isinstance(c, TrackedCache) for c in kept.values())
    assert {c.origin for c in kept.values()} == {7, 8}
    # a hit on row 7's cache goes to the followers by name
    leader.step(StepPlan(open=[OpenRow(rid=9, sampling=SamplingParams(), cache=CachePrefix(kept[7], 5), cached=5)]))
    plan, drops = _decode_wire(link.sent[-1])
    assert plan.open[0].cache == 7 and drops == []
    # the RAM tier lets row 8's cache go: the next plan tells the followers to drop theirs
    del kept[8], res
    gc.collect()
    leader.step(StepPlan())
    _, drops = _decode_wire(link.sent[-1])
    assert drops == [8]
