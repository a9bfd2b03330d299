"""Speculative decoding on the deterministic fake GPU.

* the acceptance rule and the fake GPU's γ-window verify + rollback, driven
  by hand-fabricated target tokens;
* the Scheduler's round bookkeeping (emit, owed trims, a kept cache closing
  after its trim) with fabricated step results;
* greedy output token-identical with and without speculation, both drafter
  kinds, γ = 1..4 and adaptive, batched with plain rows;
* the draft model's cache rollback;
* fallback to plain decode when the cache cannot be trimmed;
* adaptive γ turning itself off when drafts never match.

The temperature > 0 distribution test is in tests/ember/test_spec_stats.py.
"""

from __future__ import annotations

import anyio
import pytest

from actors.drafter import DraftedRound
from actors.drafter_cores import Draft, Drafted, ModelDrafterCore
from actors.scheduler_core import SchedulerConfig, SchedulerCore
from actors.spec_rounds import SpecRounds
from actors.verifier import Verdict, Verified, VerifierCore, Verify, Window, accept_window
from ember import Engine, EngineConfig, InvalidRequest, SamplingParams
from engine.eventlog import EventLog
from engine.fake.draft_model import FakeDraftModel
from engine.fake.gpu import FakeBackend, FakeGPUConfig, expected_tokens
from engine.fake.kv_cache import FakeKVCache
from engine.fake.tokenizer import ByteTokenizer
from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan, StepResult, VerifyRow
from engine.speculation.policy import GammaPolicy

EOS = ByteTokenizer.EOS


# ---------------------------------------------------------------------------
# The acceptance rule on fabricated target tokens.


def test_all_drafts_accepted_emits_the_bonus_token():
    assert accept_window([5, 6, 7], [5, 6, 7, 8]) == (3, [5, 6, 7, 8])


def test_first_mismatch_emits_the_target_correction():
    assert accept_window([5, 6, 7], [9, 6, 7, 8]) == (0, [9])
    assert accept_window([5, 6, 7], [5, 1, 7, 8]) == (1, [5, 1])
    assert accept_window([5, 6, 7], [5, 6, 2, 8]) == (2, [5, 6, 2])


def test_a_match_after_a_mismatch_is_not_accepted():
    # d3 == t2 by chance, but its context (d2) was already wrong.
    assert accept_window([5, 6, 7], [5, 0, 7, 8]) == (1, [5, 0])


def test_no_drafts_is_plain_decode():
    assert accept_window([], [4]) == (0, [4])


def test_window_and_targets_must_line_up():
    with pytest.raises(ValueError, match="needs 3 target tokens"):
        accept_window([1, 2], [1, 2])


def test_a_short_answer_means_fallback():
    core = VerifierCore(GammaPolicy(fixed=3))
    out = core.verify(Verify(windows=[Window(rid=1, drafts=[4, 5, 6], targets=[9])]))
    (v,) = out.verdicts
    assert v.fallback and v.tokens == [9] and v.accepted == 0 and v.gamma_next == 0
    assert core.stats()["fallbacks"] == 1
    # the row stays off even though its fixed γ is 3
    (v2,) = core.verify(Verify(windows=[Window(rid=1, drafts=[], targets=[2])])).verdicts
    assert v2.gamma_next == 0


# ---------------------------------------------------------------------------
# The fake GPU's γ-window verify and rollback.


def open_and_decode_first(be: FakeBackend, rid: int, prompt: list[int]) -> int:
    plan = StepPlan(
        open=[OpenRow(rid, SamplingParams())],
        prefill=[PrefillChunk(rid, prompt[:-1])],
        decode=[DecodeRow(rid, prompt[-1])],
    )
    return be.step(plan).tokens[rid]


@pytest.mark.parametrize("trim", [True, False])
def test_fake_gpu_window_verify_then_trim_continues_exactly(trim):
    prompt = list(b"speculate")
    want = expected_tokens(prompt, 8, stop_at_eos=False)
    be = FakeBackend()
    assert open_and_decode_first(be, 1, prompt) == want[0]
    wrong = (want[3] + 1) % 256
    drafts = [want[1], want[2], wrong, want[4]]
    targets = be.step(StepPlan(verify=[VerifyRow(1, [want[0], *drafts])])).verified[1]
    # position i answers the context [.., last, d1..di]
    assert targets[:3] == want[1:4]
    assert targets[3] == expected_tokens(prompt + want[:3] + [wrong], 1, stop_at_eos=False)[0]
    k, emit = accept_window(drafts, targets)
    assert (k, emit) == (2, want[1:4])
    fed, kept = 1 + len(drafts), 1 + k
    assert be.row_cache(1)[0].offset == len(prompt) + fed
    plan = StepPlan(trim=[(1, fed - kept)] if trim else [], decode=[DecodeRow(1, emit[-1])])
    nxt = be.step(plan).tokens[1]
    if trim:
        assert nxt == want[4]
        assert be.row_cache(1)[0].offset == len(prompt) + kept + 1
    else:  # negative control: a missing rollback is visible
        assert nxt != want[4]


def test_fake_gpu_refuses_a_window_it_cannot_trim():
    be = StiffBackend()
    prompt = list(b"stiff")
    want = expected_tokens(prompt, 3, stop_at_eos=False)
    open_and_decode_first(be, 1, prompt)
    got = be.step(StepPlan(verify=[VerifyRow(1, [want[0], want[1], want[2]])])).verified[1]
    assert got == [want[1]]  # only `last` was fed
    assert be.row_cache(1)[0].offset == len(prompt) + 1


# ---------------------------------------------------------------------------
# The Scheduler's side of a round, with fabricated step results.


class FixedClock:
    def now(self) -> float:
        return 0.0

    async def sleep(self, s: float) -> None:  # pragma: no cover - unused
        raise AssertionError


class RecordingPrefixCache:
    def __init__(self) -> None:
        self.puts: list[tuple[list[int], object]] = []

    def take(self, tokens, ns, min_len=1, session=None):
        return None, 0

    def put(self, tokens, ns, cache, session=None):
        self.puts.append((list(tokens), cache))


def scheduler_with_spec(gamma: int) -> tuple[SchedulerCore, VerifierCore, RecordingPrefixCache]:
    pc = RecordingPrefixCache()
    core = SchedulerCore(
        FakeBackend(),
        SchedulerConfig(max_batch=4, prefill_chunk=64),
        FixedClock(),
        EventLog(),
        pc,
        spec=SpecRounds(context_length=4096),
    )
    return core, VerifierCore(GammaPolicy(fixed=gamma)), pc


def round_trip(core: SchedulerCore, verifier: VerifierCore, result: StepResult, plan: StepPlan) -> list[int]:
    core.apply(plan, result)
    msg = core.spec.take_verify(1)
    core.apply_verified(verifier.verify(msg))
    return [t for d in core.take_outbox() for t in d.token_ids]


def draft(core: SchedulerCore, tokens: list[int]) -> list[Draft]:
    asked = core.draft_requests()
    core.spec.set_drafts(DraftedRound(drafted=[Drafted(rid=d.rid, tokens=tokens) for d in asked]), asked)
    return asked


def test_scheduler_round_accept_reject_bonus_eos_and_rollback():
    core, verifier, pc = scheduler_with_spec(gamma=3)
    prompt = [1, 2, 3, 4]
    core.admit(1, prompt, SamplingParams(max_tokens=50))

    plan = core.plan()  # open, prefill, and the first decode: always plain
    assert [d.token for d in plan.decode] == [4] and not plan.verify
    assert round_trip(core, verifier, StepResult(tokens={1: 10}), plan) == [10]

    # Round 1: d1 accepted, d2 rejected -> emit d1 + correction, owe a trim of 2.
    (asked,) = draft(core, [11, 12, 13])
    assert (asked.start, asked.tail, asked.gamma) == (0, [1, 2, 3, 4, 10], 3)
    plan = core.plan()
    assert [(v.rid, v.tokens) for v in plan.verify] == [(1, [10, 11, 12, 13])] and not plan.trim
    assert round_trip(core, verifier, StepResult(verified={1: [11, 20, 30, 40]}), plan) == [11, 20]
    row = core.rows[1]
    assert row.in_cache == len(prompt) + 2  # 4 (= last prompt token), 10, 11 are in; 20 is next input

    # Round 2: all accepted -> bonus; the previous round's trim comes first.
    (asked,) = draft(core, [21, 22, 23])
    assert (asked.start, asked.tail) == (5, [11, 20])  # only the new committed tail
    plan = core.plan()
    assert plan.trim == [(1, 2)]
    assert plan.verify[0].tokens == [20, 21, 22, 23]
    assert round_trip(core, verifier, StepResult(verified={1: [21, 22, 23, 24]}), plan) == [21, 22, 23, 24]

    # Round 3: EOS accepted inside the window: emission stops there; the cache
    # keeps exactly prompt + output and closes only after its trim.
    draft(core, [31, EOS, 33])
    plan = core.plan()
    assert not plan.trim
    assert round_trip(core, verifier, StepResult(verified={1: [31, EOS, 33, 34]}), plan) == [31]
    assert row.finish_reason == "stop"
    out = [10, 11, 20, 21, 22, 23, 24, 31]
    assert row.generated == out

    plan = core.plan()
    assert plan.trim == [(1, 2)] and plan.close == []  # fed [24, 31, EOS, 33], keeps 24 and 31
    core.apply(plan, StepResult())
    plan = core.plan()
    assert plan.close == [1] and 1 in plan.keep_cache
    core.apply(plan, StepResult(closed={1: "cache"}))
    assert pc.puts == [(prompt + out, "cache")]
    assert core.spec.take_forgotten() == [1]  # Drafter and Verifier are told to forget it


def test_scheduler_usage_counts_the_rounds():
    core, verifier, _ = scheduler_with_spec(gamma=2)
    core.admit(1, [1, 2], SamplingParams(max_tokens=5))
    plan = core.plan()
    round_trip(core, verifier, StepResult(tokens={1: 7}), plan)
    draft(core, [8, 9])
    plan = core.plan()
    round_trip(core, verifier, StepResult(verified={1: [8, 5, 6]}), plan)  # 1 of 2
    (asked,) = draft(core, [1, 2])
    assert asked.gamma == 1  # 2 tokens left
    plan = core.plan()
    assert plan.verify[0].tokens == [5, 1]
    core.apply(plan, StepResult(verified={1: [1, 2]}))  # 1 of 1 -> the bonus hits max_tokens=5
    core.apply_verified(verifier.verify(core.spec.take_verify(1)))
    (last,) = [d for d in core.take_outbox() if d.finish_reason]
    assert last.finish_reason == "length"
    spec = last.usage.speculation
    assert (spec.drafted, spec.accepted, spec.target_calls) == (3, 2, 3)
    assert spec.acceptance_rate == pytest.approx(2 / 3)
    assert spec.mean_accept_len == pytest.approx(1 + 2 / 2)
    assert core.rows[1].generated == [7, 8, 5, 1, 2]


def test_max_tokens_caps_gamma():
    core, verifier, _ = scheduler_with_spec(gamma=4)
    core.admit(1, [1, 2], SamplingParams(max_tokens=3))
    plan = core.plan()
    round_trip(core, verifier, StepResult(tokens={1: 7}), plan)
    (asked,) = core.draft_requests()
    assert asked.gamma == 1  # 2 tokens left: one draft + the bonus


def test_adaptive_gates_prompt_lookup_until_a_draft_of_its_own_is_accepted():
    """The policy's min_match rides on the Verdict to the next Draft, and
    lifts once one of the row's own drafts was accepted."""
    policy = GammaPolicy(first_match=4)
    row = policy.new_row(None)
    assert policy.min_match(row) == 4  # nothing of its own judged yet: a long match only
    policy.observe_round(row, drafted=3, accepted=0)
    assert policy.min_match(row) == 4  # rejected: still no evidence that it copies
    policy.observe_round(row, drafted=3, accepted=1)
    assert policy.min_match(row) == 0
    assert policy.min_match(policy.new_row(3)) == 0  # a fixed γ is never gated

    core, _, _ = scheduler_with_spec(gamma=3)
    core.admit(1, [1, 2, 3, 4], SamplingParams(max_tokens=50))
    plan = core.plan()
    core.apply(plan, StepResult(tokens={1: 10}))
    core.spec.take_verify(1)
    verdict = Verdict(rid=1, accepted=0, tokens=[10], gamma_next=3, min_match=4)
    core.apply_verified(Verified(verdicts=[verdict]))
    (asked,) = core.draft_requests()
    assert (asked.gamma, asked.min_match) == (3, 4)


# ---------------------------------------------------------------------------
# The engine end to end: greedy output is token-identical.

PROMPTS = [
    list(b"def main():\n    return 0\n" * 3),
    [7] * 30,
    list(range(1, 251)) + [1, 2, 3],  # 253 tokens: rounds straddle the cache's 256-token step
    list(b"hi"),
]
FAKE_EOS = FakeGPUConfig(eos_bias=7.5)  # EOS turns up, also inside accepted drafts


def requests() -> list[tuple[list[int], SamplingParams]]:
    reqs = [(p, SamplingParams(max_tokens=40)) for p in PROMPTS]
    reqs.append((PROMPTS[0], SamplingParams(max_tokens=40, stop=["e"])))
    reqs.append((PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True)))
    reqs.append((PROMPTS[3], SamplingParams(max_tokens=25, speculate=False)))  # a plain row in the batch
    return reqs


async def run_all(cfg: EngineConfig, reqs, *, backend=None) -> tuple[list[tuple[list[int], str, str]], Engine]:
    out: list = [None] * len(reqs)
    async with Engine.open(cfg, backend=backend) as engine:

        async def one(i: int) -> None:
            c = await engine.acomplete(reqs[i][0], reqs[i][1])
            out[i] = (c.token_ids, c.text, c.finish_reason, c.usage)

        async with anyio.create_task_group() as tg:
            for i in range(len(reqs)):
                tg.start_soon(one, i)
    return out, engine


def strip_usage(rows):
    return [r[:3] for r in rows]


@pytest.mark.anyio
@pytest.mark.parametrize("fake", [FakeGPUConfig(), FAKE_EOS], ids=["plain", "eos"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, None], ids=lambda g: f"gamma{g}")
@pytest.mark.parametrize("drafter", ["ngram:1:3", "fake-draft:0.7"])
async def test_greedy_speculation_is_token_identical(drafter, gamma, fake):
    base = EngineConfig(backend="fake", fake=fake, max_batch=8, prefill_chunk=96)
    reqs = requests()
    ref, _ = await run_all(base, reqs)
    for (prompt, sp), (toks, _, _, _) in zip(reqs, ref):
        if not sp.stop:
            want = expected_tokens(prompt, sp.max_tokens, fake, stop_at_eos=not sp.ignore_eos)
            assert toks == [t for t in want if t != EOS or sp.ignore_eos]
    spec = msgspec_replace(base, draft_model=drafter, num_draft_tokens=gamma)
    if drafter.startswith("fake-draft") and gamma is None:
        # A cold engine prices the drafter's step as measured (ember.spec_build.draft_prior):
        # at the default 0.19x the target's step a batch of seven does not draft at all,
        # so adaptive γ gets a drafter cheap enough to pay in this batch.
        spec = msgspec_replace(spec, fake=msgspec_replace(fake, draft_token_s=0.0001))
    got, engine = await run_all(spec, reqs)
    assert strip_usage(got) == strip_usage(ref)
    stats = engine.stats()["speculation"]
    if drafter.startswith("ngram") and gamma is None:
        # The fake GPU's text does not copy its context: prompt lookup's chance
        # matches agree for a token or two, and adaptive γ withholds them until
        # a request's own draft is accepted (GammaPolicy.min_match).
        assert stats["gated_proposals"] > 0
    else:
        assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 <= stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert got[-1][3].speculation is None  # the speculate=False row
    assert all(r[3].speculation is not None for r in got[:-1])


def msgspec_replace(cfg: EngineConfig, **kw) -> EngineConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **kw)


@pytest.mark.anyio
async def test_kept_caches_are_rolled_back_before_the_prompt_cache_reuses_them():
    """A finished row's cache goes to the prompt cache only after its owed trim:
    a follow-up that extends the first answer must still decode exactly."""
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.6", num_draft_tokens=4, prompt_cache_gib=0.5)
    prompt = list(b"a prompt worth caching")
    async with Engine.open(cfg) as engine:
        first = await engine.acomplete(prompt, SamplingParams(max_tokens=23))
        follow = prompt + first.token_ids + list(b" and more")
        second = await engine.acomplete(follow, SamplingParams(max_tokens=30))
        assert second.usage.cached_tokens > len(prompt)
    assert first.token_ids == [t for t in expected_tokens(prompt, 23) if t != EOS]
    assert second.token_ids == [t for t in expected_tokens(follow, 30) if t != EOS]


# ---------------------------------------------------------------------------
# The draft model's own cache.


class CountingDraftModel(FakeDraftModel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.trims: list[int] = []

    def trim(self, cache, n):
        self.trims.append(n)
        return super().trim(cache, n)


def test_draft_model_cache_rolls_back_with_the_target():
    model = CountingDraftModel(agree=0.6)
    core = ModelDrafterCore(model)
    fresh = ModelDrafterCore(FakeDraftModel(agree=0.6))
    ctx = list(b"context")
    core.extend([Draft(rid=1, start=0, tail=ctx, gamma=4)])
    d1 = core.draft([Draft(rid=1, start=0, tail=[], gamma=4)])[0].tokens
    assert len(d1) == 4
    row = core.rows[1]
    assert row.cached == ctx + d1[:3]  # d4 was proposed but never fed
    assert len(row.cache) == len(row.cached)

    # 1 accepted + a correction: the drafter trims back to ctx + d1[:1].
    tail = [d1[0], 99]
    core.extend([Draft(rid=1, start=len(ctx), tail=tail, gamma=3)])
    d2 = core.draft([Draft(rid=1, start=0, tail=[], gamma=3)])[0].tokens
    fresh.extend([Draft(rid=1, start=0, tail=ctx + tail, gamma=3)])
    assert d2 == fresh.draft([Draft(rid=1, start=0, tail=[], gamma=3)])[0].tokens
    assert row.cached == ctx + tail + d2[:2]
    assert model.trims == [2]  # it held d1[:3]; d1[0] matched

    # all 3 accepted + bonus: no trim, it feeds [d3, bonus] on top of what it has.
    tail2 = d2 + [77]
    core.extend([Draft(rid=1, start=len(ctx) + 2, tail=tail2, gamma=2)])
    d3 = core.draft([Draft(rid=1, start=0, tail=[], gamma=2)])[0].tokens
    assert row.cached == ctx + tail + tail2 + d3[:1]
    assert model.trims == [2]
    assert core.rebuilds == 0


def test_untrimmable_draft_cache_is_rebuilt_not_corrupted():
    core = ModelDrafterCore(FakeDraftModel(agree=0.5, trimmable=False))
    ref = ModelDrafterCore(FakeDraftModel(agree=0.5))
    ctx = list(b"xyz")
    for c in (core, ref):
        c.extend([Draft(rid=1, start=0, tail=ctx, gamma=3)])
        c.draft([Draft(rid=1, start=0, tail=[], gamma=3)])
        c.extend([Draft(rid=1, start=3, tail=[5], gamma=3)])  # rejects every draft
    got = core.draft([Draft(rid=1, start=0, tail=[], gamma=3)])
    assert got == ref.draft([Draft(rid=1, start=0, tail=[], gamma=3)])
    assert core.rebuilds == 1


# ---------------------------------------------------------------------------
# Fallback: a cache that cannot be trimmed never gets a window.


class StiffCache(FakeKVCache):
    def is_trimmable(self) -> bool:
        return False


class StiffBackend(FakeBackend):
    def make_cache(self) -> list[FakeKVCache]:
        return [StiffCache() for _ in range(self.cfg.num_layers)]


@pytest.mark.anyio
async def test_untrimmable_cache_falls_back_to_plain_decode():
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.9", num_draft_tokens=3, prompt_cache_gib=0)
    log = EventLog()
    reqs = [(p, SamplingParams(max_tokens=30)) for p in PROMPTS]
    async with Engine.open(cfg, backend=StiffBackend(cfg.fake), events=log) as engine:
        got = []
        for p, sp in reqs:
            got.append((await engine.acomplete(p, sp)).token_ids)
        stats = engine.stats()["speculation"]
    assert got == [[t for t in expected_tokens(p, 30) if t != EOS] for p, _ in reqs]
    assert stats["fallbacks"] == len(reqs)
    assert stats["spec_decode_num_draft_tokens"] == 0  # nothing was ever fed past `last`
    windows = [rid for _, f in log.of("step") for rid, _ in f.get("verify", [])]
    assert sorted(windows) == sorted(set(windows))  # one refused window per row, then plain decode


# ---------------------------------------------------------------------------
# Per-request control.


@pytest.mark.anyio
async def test_asking_for_speculation_without_a_drafter_is_an_error():
    async with Engine.open(EngineConfig(backend="fake")) as engine:
        with pytest.raises(InvalidRequest, match="no drafter"):
            await engine.acomplete([1, 2], SamplingParams(speculate=True))
        with pytest.raises(InvalidRequest, match="no drafter"):
            await engine.acomplete([1, 2], SamplingParams(num_draft_tokens=2))
        c = await engine.acomplete([1, 2], SamplingParams(max_tokens=3, speculate=False))
        assert c.usage.speculation is None


@pytest.mark.anyio
async def test_request_overrides_gamma_or_turns_speculation_off():
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.8", num_draft_tokens=1)
    log = EventLog()
    async with Engine.open(cfg, events=log) as engine:
        a = await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=40, num_draft_tokens=4))
        b = await engine.acomplete([1, 2, 3], SamplingParams(max_tokens=40, num_draft_tokens=0))
        with pytest.raises(InvalidRequest, match="num_draft_tokens"):
            await engine.acomplete([1, 2], SamplingParams(num_draft_tokens=99))
    assert a.token_ids == b.token_ids
    assert b.usage.speculation is None
    widths = {n for _, f in log.of("step") for _, n in f.get("verify", [])}
    assert max(widths) == 4


def test_bad_drafter_names_are_refused():
    with pytest.raises(InvalidRequest, match="is .ngram., .suffix. or .fake-draft"):
        Engine.start(EngineConfig(backend="fake", draft_model="tiny-draft"))
    with pytest.raises(InvalidRequest, match="use suffix, suffix.ngram or suffix:cut"):
        Engine.start(EngineConfig(backend="fake", draft_model="suffix:3"))
    with pytest.raises(InvalidRequest, match="needs a draft_model"):
        Engine.start(EngineConfig(backend="fake", num_draft_tokens=2))
    with pytest.raises(InvalidRequest, match="ngram:MIN:MAX"):
        Engine.start(EngineConfig(backend="fake", draft_model="ngram:5:2"))


# ---------------------------------------------------------------------------
# Adaptive γ on the fake GPU's cost model (virtual time).


async def timed_run(cfg: EngineConfig, prompt: list[int], n: int) -> tuple[float, object, dict]:
    async with Engine.open(cfg) as engine:
        t0 = anyio.current_time()
        c = await engine.acomplete(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        took = anyio.current_time() - t0
        stats = engine.stats().get("speculation", {})
    return took, c, stats


@pytest.mark.anyio
async def test_adaptive_gamma_turns_itself_off_when_drafts_never_match():
    prompt = list(b"nothing to guess")
    off, c_off, _ = await timed_run(EngineConfig(backend="fake"), prompt, 300)
    on, c_on, stats = await timed_run(EngineConfig(backend="fake", draft_model="fake-draft:0.0"), prompt, 300)
    assert c_on.token_ids == c_off.token_ids
    assert stats["spec_decode_num_accepted_tokens"] == 0
    rounds = c_on.usage.speculation.target_calls
    assert stats["spec_decode_num_drafts"] < 0.1 * rounds  # probes are the exception
    assert on <= 1.03 * off  # virtual time: the fake GPU's cost model, deterministic


@pytest.mark.anyio
async def test_adaptive_gamma_drafts_deeper_when_drafts_match():
    prompt = list(b"easy to guess")
    off, _, _ = await timed_run(EngineConfig(backend="fake"), prompt, 300)
    on, _, stats = await timed_run(EngineConfig(backend="fake", draft_model="fake-draft:0.95"), prompt, 300)
    chosen = {int(g): n for g, n in stats["gamma_chosen"].items()}
    deep = sum(n for g, n in chosen.items() if g >= 3)
    assert deep > 0.5 * sum(chosen.values())
    assert on < 0.7 * off


class FlakyDraftModel(FakeDraftModel):
    """Fails one draft round with an out-of-memory error."""

    def __init__(self, fail_at: int, **kw):
        super().__init__(**kw)
        self.calls, self.fail_at = 0, fail_at

    def generate(self, cache, feed, k):
        self.calls += 1
        if self.calls == self.fail_at:
            cache.append(-1)  # half-updated, as a real failure may leave it
            raise MemoryError("fake drafter: out of memory")
        return super().generate(cache, feed, k)


@pytest.mark.anyio
async def test_a_drafter_fault_costs_drafts_not_requests():
    cfg = EngineConfig(backend="fake", draft_model="fake-draft:0.9", num_draft_tokens=3)
    prompt = list(b"keep going")
    async with Engine.open(cfg) as engine:
        engine.speculation.drafter.core.model = FlakyDraftModel(fail_at=5, agree=0.9)
        c = await engine.acomplete(prompt, SamplingParams(max_tokens=60))
        stats = engine.stats()["speculation"]
    assert c.token_ids == [t for t in expected_tokens(prompt, 60) if t != EOS]
    assert stats["draft_faults"] == 1
    assert c.usage.speculation.drafted > 4 * 3  # it went on drafting after the fault...
    assert c.usage.speculation.acceptance_rate > 0.7  # ...from a rebuilt cache, not the half-updated one


def test_fake_draft_model_agrees_with_the_greedy_token_at_its_rate():
    """FakeDraftModel proposes the target's argmax with probability ``agree``
    (a uniform fixed by seed and context) and the runner-up otherwise."""
    import numpy as np

    from engine.fake.gpu import FakeGPUConfig
    from engine.fake.logits import fake_logits
    from engine.fake.tokenizer import ByteTokenizer

    cfg = FakeGPUConfig()
    for agree in (0.0, 0.7, 1.0):
        model = FakeDraftModel(agree=agree, seed=3)
        hits = 0
        for h in range(1, 4001):
            order = np.argsort(-fake_logits(cfg.seed, h, ByteTokenizer.vocab_size, cfg.eos_bias), kind="stable")
            tok = model._propose(h)
            assert tok in (order[0], order[1])
            hits += tok == order[0]
        assert abs(hits / 4000 - agree) < 0.03, (agree, hits)
    assert FakeDraftModel(agree=0.7, seed=3)._propose(99) == FakeDraftModel(agree=0.7, seed=3)._propose(99)
