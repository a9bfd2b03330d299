"""The trace format (sims.trace) and the seeded generators (sims.gen)."""

from __future__ import annotations

import statistics

import pytest

from sims import gen
from sims import trace as tr
from sims.trace import Flush, Header, Request, Restart, Sampling, Sessions, Trace, TraceError


def lines(*records: str) -> str:
    return "\n".join(records) + "\n"


HEADER = '{"type":"header","version":1,"kind":"custom"}'


@pytest.mark.parametrize("kind", sorted(gen.GENERATORS))
def test_generated_traces_round_trip_through_ndjson(kind):
    t = gen.GENERATORS[kind](5, requests=30)
    data = t.encode()
    back = tr.loads(data)
    assert back.header == t.header
    assert back.events == t.events
    assert back.encode() == data
    assert len(back.requests) == 30
    assert all(line.startswith(b'{"type":') for line in data.splitlines())


@pytest.mark.parametrize("kind", sorted(gen.GENERATORS))
def test_generators_are_seeded(kind):
    make = gen.GENERATORS[kind]
    assert make(3, requests=25).encode() == make(3, requests=25).encode()
    assert make(3, requests=25).encode() != make(4, requests=25).encode()


def test_bundled_traces_are_what_the_documented_commands_generate():
    # sims/traces/README-style provenance: each file is one `python -m sims.gen` command
    assert tr.bundled("agent-small").encode() == gen.agent(1, requests=40).encode()
    assert tr.bundled("restart-small").encode() == gen.restart(1, requests=40).encode()
    assert tr.bundled("chat-small-tokens").encode() == gen.as_tokens(gen.chat(1, requests=80)).encode()
    with pytest.raises(TraceError, match="no bundled trace 'nope'.*agent-small"):
        tr.bundled("nope")


def test_gen_cli_writes_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "a.ndjson"
    assert gen.main(["--kind", "agent", "--seed", "3", "--requests", "12", "--out", str(out)]) == 0
    t = tr.read(out)
    assert t.header.kind == "agent" and t.header.seed == 3 and len(t.requests) == 12
    assert "requests=12" in capsys.readouterr().err
    assert gen.main(["--kind", "chat", "--seed", "2", "--requests", "5", "--tokens"]) == 0
    t2 = tr.loads(capsys.readouterr().out)
    assert all(r.tokens is not None and r.text is None for r in t2.requests)


def test_agent_sessions_share_a_system_prompt_and_grow_their_context():
    t = gen.agent(11, requests=80)
    firsts = [r for r in t.requests if r.continues is None]
    turns = [r for r in t.requests if r.continues is not None]
    assert len(firsts) >= 3 and len(turns) > len(firsts)  # multi-turn
    system = firsts[0].text.split("<|user|>")[0]
    assert len(system) > 2000 and all(r.text.startswith(system) for r in firsts)
    assert all("<|tool|>" in r.text or "Sub-task" in r.text for r in turns)
    # replaying with each turn answered by a fixed output: contexts grow turn by turn, within budget
    s = Sessions(t)
    size: dict[str, int] = {}
    for r in t.requests:
        p = s.prompt(r)
        if r.continues == r.session:
            assert len(p) > size[r.session]
        size[r.session] = len(p)
        s.done(r, p, "x" * r.max_tokens)
    assert max(size.values()) <= 12_000
    # pauses between a session's turns (tool time), never a turn before the one it continues
    parents = t.parents()
    by_id = {r.id: r for r in t.requests}
    assert all(by_id[p].t < by_id[c].t for c, p in parents.items())


def test_chat_is_bursty():
    t = gen.chat(2, requests=400)
    times = [r.t for r in t.requests]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # a Poisson stream has a coefficient of variation of 1; bursts with quiet gaps are far above
    assert statistics.pstdev(gaps) / statistics.mean(gaps) > 2.0
    assert any(r.continues for r in t.requests)
    assert any(r.sampling.temperature > 0 and r.sampling.seed is not None for r in t.requests)


def test_restart_trace_has_graceful_restarts_crashes_and_a_flush_before_a_crash():
    t = gen.restart(4, requests=50, restarts=3)
    controls = [e for e in t.events if not isinstance(e, Request)]
    restarts = [e for e in controls if isinstance(e, Restart)]
    assert [r.crash for r in restarts] == [False, True, True]
    flush = next(e for e in controls if isinstance(e, Flush))
    assert any(r.crash and r.t > flush.t for r in restarts)
    assert t.requests[0].t < restarts[0].t < t.requests[-1].t  # in the middle of traffic


def test_sessions_resolve_text_and_token_continuations():
    text = Trace(
        Header(),
        [
            Request(id=0, t=0.0, session="a", text="hello ", max_tokens=3),
            Request(id=1, t=1.0, session="a", continues="a", text=" again", max_tokens=3),
            Request(id=2, t=1.5, session="b", continues="a", text=" forked", max_tokens=3),
        ],
    )
    s = Sessions(tr.validate(text.header, text.events))
    p0 = s.prompt(text.events[0])
    s.done(text.events[0], p0, "world")
    p1 = s.prompt(text.events[1])
    assert p1 == "hello world again"
    s.done(text.events[1], p1, "!")
    assert s.prompt(text.events[2]) == "hello world again! forked"  # the latest turn of session a
    # token space: text turns are encoded, outputs are token ids
    s2 = Sessions(text, encode=lambda x: list(x.encode()))
    q0 = s2.prompt(text.events[0])
    s2.done(text.events[0], q0, [1, 2])
    assert s2.prompt(text.events[1]) == list(b"hello ") + [1, 2] + list(b" again")


def test_a_context_is_dropped_once_its_last_continuation_read_it():
    t = gen.agent(2, requests=30)
    s = Sessions(t)
    for r in t.requests:
        p = s.prompt(r)
        s.done(r, p, "out")
    assert s.context == {}


@pytest.mark.parametrize(
    "body, message",
    [
        ("", "empty"),
        (
            '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":1}',
            "line 1: the first record must be the header",
        ),
        ('{"type":"header","version":9}', "version 9 is not supported"),
        (
            lines(
                HEADER,
                '{"type":"request","id":0,"t":1,"session":"a","text":"x","max_tokens":1}',
                '{"type":"flush","t":0.5}',
            ),
            "line 3: time 0.5 goes back",
        ),
        (
            lines(
                HEADER,
                '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":1}',
                '{"type":"request","id":0,"t":1,"session":"b","text":"y","max_tokens":1}',
            ),
            "line 3: request id 0 is used twice",
        ),
        (
            lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","continues":"z","text":"x","max_tokens":1}'),
            "continues session 'z', which has no earlier turn",
        ),
        (
            lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","text":"x","tokens":[1],"max_tokens":1}'),
            "exactly one of text or tokens",
        ),
        (
            lines(
                HEADER,
                '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":1}',
                '{"type":"request","id":1,"t":1,"session":"a","continues":"a","tokens":[1],"max_tokens":1}',
            ),
            "mixes text and token prompts",
        ),
        (
            lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":0}'),
            "max_tokens must be >= 1",
        ),
        (
            lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","text":"","max_tokens":2}'),
            "the prompt is empty",
        ),
        (
            lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":1,"temperature":1}'),
            "line 2: Object contains unknown field `temperature`",
        ),
        (lines(HEADER, '{"type":"boom","t":0}'), "line 2: Invalid value 'boom'"),
        (lines(HEADER, HEADER), "line 2: a second header"),
    ],
)
def test_bad_traces_are_rejected_with_the_line(body, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tr.loads(body)


def test_restart_lines_always_say_whether_they_crash():
    t = Trace(Header(), [Restart(t=1.0), Restart(t=2.0, crash=False), Flush(t=3.0)])
    data = t.encode().decode()
    assert '"crash":true' in data and '"crash":false' in data
    assert tr.loads(data).events == t.events
    assert (
        Sampling()
        == tr.loads(lines(HEADER, '{"type":"request","id":0,"t":0,"session":"a","text":"x","max_tokens":1}'))
        .requests[0]
        .sampling
    )
