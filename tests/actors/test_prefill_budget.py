"""The prefill budget while rows decode (actors.prefill_budget): a long prompt
arriving must not stall the running streams for a whole 512-token chunk."""

from __future__ import annotations

from actors.prefill_budget import PrefillBudget
from actors.scheduler_core import SchedulerConfig, SchedulerCore
from engine.eventlog import EventLog
from engine.types import SamplingParams
from tests.ember.test_spec_fake import FakeBackend, FixedClock


def test_the_full_chunk_when_nothing_decodes_and_a_small_one_before_the_prefill_is_priced():
    b = PrefillBudget(512, 0.5, floor=16)
    assert b.budget(decoding=False) == 512
    # Rows that started in prefilling steps (requests arriving together): no
    # decode-only step to price against yet, and every step keeps prefilling.
    assert b.budget(decoding=True) == 512
    b.observe(0, decoding=True, seconds=0.1)
    assert b.budget(decoding=True) == 16  # decode priced, prefill not: measure before spending the streams' time
    assert PrefillBudget(512, None).budget(decoding=True) == 512  # share None: the old behaviour


def test_the_budget_is_a_share_of_a_decode_step_at_the_measured_price():
    b = PrefillBudget(512, 0.5, floor=16)
    b.observe(0, decoding=True, seconds=0.100)  # a decode step: 100 ms
    b.observe(16, decoding=True, seconds=0.100 + 16 * 0.002)  # 2 ms per prompt token beside it
    assert b.budget(decoding=True) == 25  # 0.5 x 100 ms / 2 ms
    for _ in range(20):  # the prompt's tokens get dearer with the offset: the chunk shrinks, to the floor
        b.observe(25, decoding=True, seconds=0.100 + 25 * 0.020)
    assert b.budget(decoding=True) == 16
    cheap = PrefillBudget(512, 0.5)
    cheap.observe(0, decoding=True, seconds=0.1)
    cheap.observe(100, decoding=False, seconds=100 * 1e-5)  # alone: all of the step is prefill
    assert cheap.budget(decoding=True) == 512  # capped at the chunk


def test_the_scheduler_shrinks_a_long_prefill_beside_a_decoding_row():
    core = SchedulerCore(
        FakeBackend(), SchedulerConfig(max_batch=4, prefill_chunk=512, prefill_share=0.5), FixedClock(), EventLog()
    )
    core.admit(1, [1, 2, 3], SamplingParams(max_tokens=100))
    plan = core.plan()  # the short prompt (its last token decodes in this same step)
    assert [len(c.tokens) for c in plan.prefill] == [2]
    core.prefill_budget.observe(0, decoding=True, seconds=0.1)  # a decode-only step: 100 ms
    core.admit(2, list(range(1, 2001)), SamplingParams(max_tokens=1))
    plan = core.plan()
    assert [len(c.tokens) for c in plan.prefill] == [16] and len(plan.decode) == 1
    core.note_step_time(plan, 0.1 + 16 * 0.001)  # 1 ms per prompt token beside the decode
    plan = core.plan()
    assert [len(c.tokens) for c in plan.prefill] == [50]  # 0.5 x 100 ms / 1 ms per token


def test_short_prompts_beside_decoding_rows_prefill_whole_up_to_the_burst():
    b = PrefillBudget(512, 0.5, floor=16, burst=16)
    assert b.whole(decoding=True) == 0  # nothing priced yet: the budget alone (the full chunk, above)
    b.observe(0, decoding=True, seconds=0.100)
    b.observe(16, decoding=True, seconds=0.100 + 16 * 0.005)  # 5 ms per prompt token beside a decode
    assert b.whole(decoding=True) == 320  # 16 decode steps' time: 16 x 100 ms / 5 ms
    assert b.whole(decoding=False) == 0  # nothing decodes: the full chunk is the budget anyway
    assert PrefillBudget(512, None).whole(decoding=True) == 0  # share None: the old behaviour


def test_a_burst_of_short_prompts_is_admitted_together_while_a_long_one_is_still_chunked():
    # Eight 48-token requests sent together had been admitted one per ~0.55 s at the
    # floor's 16 tokens a step: 0.71x mlx_lm.server's 8-stream aggregate (issue #45).
    core = SchedulerCore(
        FakeBackend(), SchedulerConfig(max_batch=8, prefill_chunk=512, prefill_share=0.5), FixedClock(), EventLog()
    )
    core.admit(1, [1, 2, 3], SamplingParams(max_tokens=100))
    core.plan()
    core.prefill_budget.observe(0, decoding=True, seconds=0.1)  # a decode-only step: 100 ms
    core.prefill_budget.observe(16, decoding=True, seconds=0.1 + 16 * 0.005)  # 5 ms a prompt token
    for rid in range(2, 8):  # six short prompts: 47 tokens each to prefill
        core.admit(rid, list(range(1, 49)), SamplingParams(max_tokens=8))
    core.admit(8, list(range(1, 2001)), SamplingParams(max_tokens=1))  # and a long one
    plan = core.plan()
    chunks = {c.rid: len(c.tokens) for c in plan.prefill}
    # 320 tokens whole (6 x 47 = 282), the long prompt by the share (0.5 x 100 ms / 5 ms = 10 -> the floor, 16)
    assert chunks == {2: 47, 3: 47, 4: 47, 5: 47, 6: 47, 7: 47, 8: 16}
