"""``--distributed`` as a flag: what it turns off and what it refuses, checked
before anything loads (the two-rank engine itself: tests/sims/test_distributed.py)."""

from __future__ import annotations

import os
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
    assert (config.distributed, config.prompt_cache_gib) == ("tensor", 1.0)
    # the SSD tier is on by default for serve (#32); each rank gets its own shard folder under it
    assert config.ssd_cache_dir and config.ssd_cache_dir.startswith(os.environ["EMBER_KV_CACHE_DIR"])
    assert config.step_timeout_s and config.step_timeout_s > 0  # a hung rank ends as engine_dead


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--fake-gpu"], "needs the MLX backend"),
    ],
)
def test_refused_combinations_exit_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        args = build_parser().parse_args(["serve", "--distributed", "pipeline", *flags])
        engine_config(args, args.parser)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_the_ssd_tier_is_accepted_with_its_ram_tier():
    # each rank persists its own shard (actors.distributed_tier); the RAM tier it spills from is still required
    args = build_parser().parse_args(["serve", "--distributed", "tensor", "--ssd-cache", "/tmp/x"])
    assert engine_config(args, args.parser).ssd_cache_dir == "/tmp/x"
    with pytest.raises(InvalidRequest, match="needs the RAM tier"):
        EngineConfig(distributed="tensor", ssd_cache_dir="/tmp/x", prompt_cache_gib=0).validate()


def test_unknown_mode_is_refused():
    with pytest.raises(InvalidRequest, match="tensor or pipeline"):
        EngineConfig(distributed="data").validate()


def test_a_step_plan_survives_the_wire():
    from engine.mlx.cache_views import CachePrefix
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
    """Closes every row it is told to, keeping its cache, and copies the
    checkpoints asked for (but those of ``fail``): what MLXBackend hands back."""

    def __init__(self, fail: frozenset[int] = frozenset()):
        self.fail = fail

    def step(self, plan: StepPlan) -> Any:
        from engine.ports import StepResult

        res = StepResult()
        for rid in plan.close:
            if rid in plan.keep_cache:
                res.closed[rid] = [f"kv-of-{rid}"]
        for rid in plan.checkpoint - self.fail:
            res.checkpoints[rid] = [f"checkpoint-of-{rid}"]
        return res


def test_rank0_names_the_caches_it_keeps_and_tells_when_it_drops_them():
    import gc

    from engine.mlx.cache_views import CachePrefix
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


def test_rank0_names_checkpoints_as_every_follower_does():
    """Checkpoints (caches of sliding windows or SSM state, which cannot be
    trimmed back) are RAM-tier entries: named from the plan number and the
    plan's rows, which every follower knows, so nothing more goes on the wire."""
    from engine.mlx.distributed import CHECKPOINT_NAMES, LeaderBackend, _decode_wire, checkpoint_names

    link = _Link()
    leader = LeaderBackend(_Inner(fail=frozenset({4})), link)  # type: ignore[arg-type]
    leader.step(StepPlan())
    res = leader.step(StepPlan(checkpoint={5, 3, 4}))
    names = checkpoint_names(2, {3, 4, 5})
    assert {rid: c.origin for rid, c in res.checkpoints.items()} == {3: names[3], 5: names[5]}
    assert len(set(names.values())) == 3 and min(names.values()) > CHECKPOINT_NAMES  # never a row id
    # row 4's copy failed here: the followers' copy of it is let go with the next plan
    leader.step(StepPlan())
    assert _decode_wire(link.sent[-1])[1] == [names[4]]
    assert checkpoint_names(3, {3}) != checkpoint_names(2, {3})  # a later plan, another name
