"""Shared prefill (``SchedulerConfig.shared_prefill_min``): requests arriving
together on one cold prefix (subagents on a system prompt) prefill it once —
the first row prefills, a checkpoint at the end of the shared prefix goes into
the RAM tier, the others wait for it and prefill only their own tails — with
the same tokens as each alone (the fake GPU's ``expected_tokens``). On the fake
GPU with checkpoints turned on for the test (it says it cannot by default)."""

from __future__ import annotations

import anyio
import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.fake.gpu import FakeBackend, expected_tokens

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
HEAD = list(b"<|system|>" + b"You are a subagent. The repository follows. " * 40)  # ~1.8k tokens
ASKS = [HEAD + list(f"<|user|>find the bug in part {i}\n<|assistant|>".encode()) for i in range(4)]


class Checkpointing(FakeBackend):
    can_checkpoint = True


class LosesCheckpoints(Checkpointing):
    """Says it can checkpoint, then never hands one over (a failed copy)."""

    def step(self, plan):
        res = super().step(plan)
        res.checkpoints.clear()
        return res


async def burst(backend: FakeBackend, namespaces: tuple[str, ...] = ("",), **kw):
    """ASKS at once, request i in namespace ``namespaces[i % len(namespaces)]``."""
    outs: list = [None] * len(ASKS)
    async with Engine.open(EngineConfig(backend="fake", **kw), backend=backend) as engine:

        async def one(i: int) -> None:
            outs[i] = await engine.acomplete(ASKS[i], PARAMS, ns=namespaces[i % len(namespaces)])

        async with anyio.create_task_group() as tg:
            for i in range(len(ASKS)):
                tg.start_soon(one, i)
        return outs, engine.stats()["scheduler"]


async def test_a_cold_shared_prefix_is_prefilled_once():
    outs, sched = await burst(Checkpointing())
    shared = len(HEAD) + len(b"<|user|>find the bug in part ")
    assert [o.token_ids for o in outs] == [expected_tokens(a, 5, stop_at_eos=False) for a in ASKS]
    assert sorted(o.usage.cached_tokens for o in outs) == [0, shared, shared, shared]
    assert sched["prefill_waits"] == 3 and sched["shared_prefix_checkpoints"] == 1
    # the producer's whole prompt once, then each waiter's tail past the shared prefix
    assert sched["prefilled_tokens"] == sum(len(a) - 1 for a in ASKS) - 3 * shared


async def test_only_a_producer_of_the_same_namespace_is_waited_for():
    """Two keys (or adapters) on one prefix: each namespace prefills it once;
    a row never waits for a checkpoint it could not read."""
    outs, sched = await burst(Checkpointing(), namespaces=("key:alice", "key:bob"))
    shared = len(HEAD) + len(b"<|user|>find the bug in part ")
    assert [o.token_ids for o in outs] == [expected_tokens(a, 5, stop_at_eos=False) for a in ASKS]
    assert sorted(o.usage.cached_tokens for o in outs) == [0, 0, shared, shared]
    assert sched["prefill_waits"] == 2 and sched["shared_prefix_checkpoints"] == 2


async def test_off_each_request_prefills_its_own():
    outs, sched = await burst(Checkpointing(), shared_prefill_min=0)
    assert [o.token_ids for o in outs] == [expected_tokens(a, 5, stop_at_eos=False) for a in ASKS]
    assert sched["prefill_waits"] == 0 and sched["prefilled_tokens"] == sum(len(a) - 1 for a in ASKS)


async def test_no_checkpoint_no_wait_forever():
    outs, sched = await burst(LosesCheckpoints())
    assert [o.token_ids for o in outs] == [expected_tokens(a, 5, stop_at_eos=False) for a in ASKS]
    # a waiter goes on once its producer passed the prefix; it may then wait on
    # another waiter, or hit the producer's finished entry: every one ends
    assert sched["prefill_waits"] >= 3 and sched["shared_prefix_checkpoints"] == 0
    shared = len(HEAD) + len(b"<|user|>find the bug in part ")
    assert sched["prefilled_tokens"] > sum(len(a) - 1 for a in ASKS) - 3 * shared


async def test_a_backend_that_cannot_checkpoint_never_holds_a_request():
    outs, sched = await burst(FakeBackend())
    assert sched["prefill_waits"] == 0 and all(o.usage.cached_tokens == 0 for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the MLX thread needs a real loop
async def test_on_mlx_the_same_tokens_with_one_prefill_of_the_prefix():
    """The tiny model on MLX (which checkpoints any row): the burst's greedy
    answers equal those of the same burst with shared prefill off, and the
    prefix is prefilled once instead of four times."""
    asks = [[5 + (i * 7) % 1900 for i in range(700)] + [100 + k, 200 + k, 300 + k] for k in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def run(**kw):
        outs: list = [None] * len(asks)
        async with Engine.open(EngineConfig(backend="mlx", model="tiny", **kw)) as engine:

            async def one(i: int) -> None:
                outs[i] = await engine.acomplete(asks[i], params)

            async with anyio.create_task_group() as tg:
                for i in range(len(asks)):
                    tg.start_soon(one, i)
            return [o.token_ids for o in outs], engine.stats()["scheduler"]

    shared_ids, shared = await run()
    alone_ids, alone = await run(shared_prefill_min=0)
    assert shared_ids == alone_ids
    assert alone["prefilled_tokens"] == 4 * 702 and alone["prefill_waits"] == 0
    assert shared["prefill_waits"] == 3 and shared["prefilled_tokens"] == 702 + 3 * 2
