"""Suffix decoding (``--draft-model suffix``) end to end on the fake GPU, in
virtual time:

* greedy output token-identical with suffix decoding on and off (and composed
  with prompt lookup), fixed γ and adaptive, batched with a plain row;
* a second request whose reply repeats an earlier reply's text (the scripted
  model: one reply whatever the prompt) gets its drafts from the namespace's
  store and accepts them, where prompt lookup has nothing to copy;
* a request in another namespace gets none of that text;
* the per-proposer counters in ``/stats`` and ``/metrics``.
"""

from __future__ import annotations

import json

import anyio
import msgspec
import pytest

from ember import Engine, EngineConfig, SamplingParams
from engine.fake.gpu import FakeGPUConfig
from tests.ember.test_spec_fake import FAKE_EOS, requests, run_all, strip_usage

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("fake", [FakeGPUConfig(), FAKE_EOS], ids=["plain", "eos"])
@pytest.mark.parametrize("gamma", [3, None], ids=lambda g: f"gamma{g}")
@pytest.mark.parametrize("drafter", ["suffix", "suffix+ngram"])
async def test_greedy_output_is_identical_with_suffix_decoding(drafter, gamma, fake):
    base = EngineConfig(backend="fake", fake=fake, max_batch=8, prefill_chunk=96)
    reqs = requests()
    ref, _ = await run_all(base, reqs)
    # twice over: the second pass drafts from the first pass's replies
    cfg = msgspec.structs.replace(base, draft_model=drafter, num_draft_tokens=gamma)
    async with Engine.open(cfg) as engine:
        for _ in range(2):
            got = [None] * len(reqs)

            async def one(i: int) -> None:
                c = await engine.acomplete(reqs[i][0], reqs[i][1])
                got[i] = (c.token_ids, c.text, c.finish_reason, c.usage)

            async with anyio.create_task_group() as tg:
                for i in range(len(reqs)):
                    tg.start_soon(one, i)
            assert strip_usage(got) == strip_usage(ref)
        stats = engine.stats()["speculation"]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["suffix_learned_requests"] == 2 * len(reqs)  # the plain row's text is learned too
    assert set(stats["by_proposer"]) <= {"suffix", "ngram"}
    by = stats["by_proposer"]
    assert sum(c["spec_decode_num_draft_tokens"] for c in by.values()) == stats["spec_decode_num_draft_tokens"]


REPLY = (
    "I will read src/engine/cache.py, then run pytest tests/test_cache.py -k eviction "
    "and compare the eviction order with the one in docs/cache.md."
)


def _script(tmp_path) -> str:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"rules": [], "default": REPLY}))
    return str(path)


async def _ask(engine: Engine, text: str, ns: str, params: SamplingParams):
    prompt = engine.chat_prompt([{"role": "user", "content": text}])
    c = await engine.acomplete(prompt, params, ns=ns)
    return c


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
async def test_a_reply_repeating_an_earlier_one_is_drafted_from_the_store(tmp_path, drafter):
    cfg = EngineConfig(backend="scripted", model=_script(tmp_path), draft_model=drafter, num_draft_tokens=4)
    params = SamplingParams(max_tokens=200)
    async with Engine.open(cfg) as engine:
        first = await _ask(engine, "What is next?", "team-a", params)
        second = await _ask(engine, "And after that, what do you do?", "team-a", params)
        other = await _ask(engine, "Anything else to do?", "team-b", params)
        stats = engine.stats()["speculation"]
    assert first.text == second.text == other.text == REPLY
    n = len(second.token_ids)
    if drafter == "ngram":
        # the reply is in neither prompt: prompt lookup has (almost) nothing to copy
        assert second.usage.speculation.accepted < n // 4
        return
    # the second reply is the first one's text: nearly all of it accepted from the store
    assert second.usage.speculation.accepted >= n * 3 // 4, second.usage.speculation
    assert second.usage.speculation.target_calls <= n // 3
    # another namespace never sees team-a's text
    assert other.usage.speculation.accepted < n // 4, other.usage.speculation
    assert stats["suffix_namespaces"] == 2
    assert stats["suffix_proposals"]["store"] > 0
    by = stats["by_proposer"]["suffix"]
    assert by["spec_decode_num_accepted_tokens"] >= second.usage.speculation.accepted
    assert len(by["spec_decode_num_accepted_tokens_per_pos"]) == 4  # fixed γ = 4: positions 0..3


async def test_metrics_label_the_counters_by_proposer(tmp_path):
    from transport.wire.metrics import Metrics

    cfg = EngineConfig(backend="scripted", model=_script(tmp_path), draft_model="suffix+ngram", num_draft_tokens=4)
    async with Engine.open(cfg) as engine:
        for text in ("one", "two"):
            await _ask(engine, text, "", SamplingParams(max_tokens=200))
        text = Metrics(lambda: {"m": engine.stats()}).render().decode()
        stats = engine.stats()["speculation"]["by_proposer"]
    for proposer, counters in stats.items():
        n = counters["spec_decode_num_accepted_tokens"]
        assert f'ember_spec_decode_num_accepted_tokens_total{{model="m",proposer="{proposer}"}} {float(n)}' in text
        first = counters["spec_decode_num_accepted_tokens_per_pos"][0]
        line = f'ember_spec_decode_num_accepted_tokens_per_pos_total{{model="m",pos="0",proposer="{proposer}"}}'
        assert f"{line} {float(first)}" in text
    assert "suffix" in stats


def test_reach_is_offered_only_to_a_lone_adaptive_row_at_the_deepest_gamma():
    """``Draft.reach`` (a long match may draft past γ) goes only to a lone
    adaptive row the policy drafts at γ_max, within the row's room, with the
    window's price from the verdict (the proposer cuts its draft by it); the
    Scheduler keeps up to that many drafts; a finished row's text goes to the
    Drafter with its namespace."""
    from actors.drafter import DraftedRound
    from actors.drafter_cores import Drafted
    from actors.scheduler_core import SchedulerConfig, SchedulerCore
    from actors.spec_rounds import SpecRounds
    from actors.verifier import Verdict, Verified
    from engine.eventlog import EventLog
    from engine.fake.gpu import FakeBackend
    from engine.ports import StepResult
    from engine.speculation.policy import ADAPTIVE_GAMMA_MAX
    from tests.ember.test_spec_fake import FixedClock

    def core_with(gamma: int, *rids_ns: tuple[int, str], fixed=None, max_tokens=100):
        core = SchedulerCore(
            FakeBackend(),
            SchedulerConfig(max_batch=4, prefill_chunk=64),
            FixedClock(),
            EventLog(),
            spec=SpecRounds(context_length=4096, reach=24, learns=True),
        )
        for rid, ns in rids_ns:
            core.admit(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, num_draft_tokens=fixed), ns=ns)
        plan = core.plan()
        core.apply(plan, StepResult(tokens={rid: 10 for rid, _ in rids_ns}))
        core.spec.take_verify(len(rids_ns))
        verdicts = [Verdict(rid=rid, accepted=0, tokens=[10], gamma_next=gamma) for rid, _ in rids_ns]
        core.apply_verified(Verified(verdicts=verdicts, price=[1.4, 0.1]))
        return core

    core = core_with(ADAPTIVE_GAMMA_MAX, (1, "team"))
    (asked,) = core.draft_requests()
    assert (asked.gamma, asked.reach, asked.ns, asked.price) == (ADAPTIVE_GAMMA_MAX, 24, "team", [1.4, 0.1])
    core.spec.set_drafts(DraftedRound(drafted=[Drafted(rid=1, tokens=list(range(30)), proposer="suffix")]), [asked])
    assert core.spec.rows[1].drafts == list(range(24)) and core.spec.rows[1].proposer == "suffix"
    assert core_with(ADAPTIVE_GAMMA_MAX, (1, ""), max_tokens=12).draft_requests()[0].reach == 10  # its room
    assert core_with(ADAPTIVE_GAMMA_MAX - 1, (1, "")).draft_requests()[0].reach == 0  # not at the deepest
    assert core_with(ADAPTIVE_GAMMA_MAX, (1, ""), fixed=6).draft_requests()[0].reach == 0  # a fixed γ
    batch = core_with(ADAPTIVE_GAMMA_MAX, (1, ""), (2, "")).draft_requests()
    assert [(d.reach, d.price) for d in batch] == [(0, []), (0, [])]  # a batch: γ caps the drafts, unpriced
    # a finished row's text (prompt + output) goes to the Drafter, the part it has not seen
    core.abort(1)
    (f,) = core.spec.take_finished()
    assert (f.rid, f.ns, f.start, f.prompt_len) == (1, "team", 5, 4) and f.tail == []
