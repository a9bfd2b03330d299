"""Seeded trace generators: coding-agent sessions, bursty chat, restarts.

    python -m sims.gen --kind agent --seed 3 --out agent.ndjson
    python -m sims.gen --kind chat --seed 1 --requests 10000 --out chat.ndjson

Everything comes from one ``random.Random(seed)``, so a (kind, seed, options)
triple is a trace. Prompts are text; ``--tokens`` writes them as UTF-8 byte
ids instead (the fake GPU's tokenizer), which exercises token-id prompts.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

from sims.trace import Event, Flush, Header, Request, Restart, Sampling, Trace, validate

WORDS = (
    "the cache token prefix model batch layer request server decode prefill write disk "
    "flush crash restore tensor scheduler actor queue session agent tool file index key "
    "value offset trim copy step time seed fault sync rename directory checksum header "
    "stream delta error retry budget memory bytes page entry evict spill snapshot idle busy "
    "a an of to in on for with from by and or not is are was be this that it we you they "
    "read parse build test run check fix add remove update return call open close load save"
).split()

IDENTS = "x y n i buf cfg row rid plan cache item path data out res ctx tok key val".split()


class Text:
    """Deterministic filler text: prose, code and tool output."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def prose(self, n_bytes: int) -> str:
        out: list[str] = []
        size = 0
        while size < n_bytes:
            w = self.rng.choice(WORDS)
            out.append(w)
            size += len(w) + 1
        s = " ".join(out)
        return s[0].upper() + s[1:n_bytes] + "."

    def code(self, n_bytes: int) -> str:
        lines: list[str] = []
        size = 0
        while size < n_bytes:
            r = self.rng
            name = f"{r.choice(WORDS)}_{r.choice(WORDS)}"
            a, b = r.choice(IDENTS), r.choice(IDENTS)
            line = r.choice(
                (
                    f"def {name}({a}, {b}):",
                    f"    {a} = {name}({b}) + {r.randint(0, 99)}",
                    f"    if {a} > {b}:",
                    f"        return {a}",
                    f"    for {a} in range({r.randint(1, 64)}):",
                    f"# {self.prose(r.randint(20, 60))}",
                )
            )
            lines.append(line)
            size += len(line) + 1
        return "\n".join(lines)

    def tool_output(self, n_bytes: int) -> str:
        kind = self.rng.random()
        if kind < 0.5:
            body = self.code(n_bytes)
        elif kind < 0.8:
            body = "\n".join(
                f"{self.rng.choice(('PASSED', 'FAILED', 'ok'))} tests/test_{self.rng.choice(WORDS)}.py::{self.rng.choice(WORDS)}"
                for _ in range(max(1, n_bytes // 40))
            )
        else:
            body = self.prose(n_bytes)
        return body


def _sampling(rng: random.Random, sampled_frac: float) -> Sampling:
    if rng.random() < sampled_frac:
        return Sampling(temperature=0.7, top_p=0.95, seed=rng.randrange(2**31))
    return Sampling()


# ---------------------------------------------------------------------------
# Generators. Each returns a validated Trace.


def agent(
    seed: int,
    *,
    requests: int = 120,
    session_rate: float = 0.25,  # new sessions per second
    system_bytes: int = 2500,
    context_max_bytes: int = 12_000,
    think_mean_s: float = 3.0,
    sampled_frac: float = 0.15,
    fork_prob: float = 0.08,
) -> Trace:
    """Coding-agent sessions: one long system prompt shared by every session,
    a task, then turns that each append a tool result to the growing context
    (``continues``), separated by tool/think pauses; sometimes a sub-agent
    forks a session's context."""
    rng = random.Random(seed)
    text = Text(rng)
    system = "<|system|>You are a coding agent. " + text.prose(system_bytes) + "\n"
    out: list[Request] = []
    t_session = 0.0
    for n_session in range(requests):  # at most one request per session: enough
        if len(out) >= requests:
            break
        t_session += rng.expovariate(session_rate)
        sid = f"a{n_session}"
        task = system + "<|user|>" + text.prose(rng.randint(80, 400)) + "\n<|assistant|>"
        # (arrival, session, continues, new text, context bound, turns left)
        todo: list[tuple[float, str, str | None, str, int, int]] = [(t_session, sid, None, task, 0, rng.randint(2, 14))]
        while todo and len(out) < requests:
            t, session, continues, new, bound, turns_left = todo.pop()
            mt = rng.randint(16, 200)
            out.append(
                Request(
                    id=-1,
                    t=round(t, 3),
                    session=session,
                    continues=continues,
                    text=new,
                    max_tokens=mt,
                    sampling=_sampling(rng, sampled_frac),
                )
            )
            bound += len(new) + mt
            if turns_left <= 1:
                continue
            tool = "<|tool|>" + text.tool_output(int(rng.lognormvariate(6.3, 0.9)) + 20) + "\n<|assistant|>"
            if bound + len(tool) + 200 > context_max_bytes:
                continue  # the session ends when its context would outgrow the budget
            t_next = t + mt * 0.012 + 0.05 + rng.expovariate(1.0 / think_mean_s)
            todo.append((t_next, session, session, tool, bound, turns_left - 1))
            if rng.random() < fork_prob:
                # a sub-agent starts from this session's context and runs alongside it
                sub = f"{session}.{len(out)}"
                ask = "<|user|>Sub-task: " + text.prose(rng.randint(40, 200)) + "\n<|assistant|>"
                todo.append(
                    (t_next + rng.expovariate(2.0), sub, session, ask, bound + len(tool) + 200, rng.randint(1, 4))
                )
    return _finish(Header(kind="agent", seed=seed, description=f"{requests} coding-agent turns"), out, [])


def chat(
    seed: int,
    *,
    requests: int = 200,
    burst_gap_mean_s: float = 15.0,
    burst_size: tuple[int, int] = (5, 60),
    burst_rate: tuple[float, float] = (10.0, 80.0),
    follow_up_frac: float = 0.3,
    sampled_frac: float = 0.2,
) -> Trace:
    """Bursty chat: quiet gaps, then bursts of short requests at a high rate;
    a few personas' system prompts shared across users; some follow-ups."""
    rng = random.Random(seed)
    text = Text(rng)
    personas = ["<|system|>" + text.prose(rng.randint(100, 600)) + "\n" for _ in range(3)]
    out: list[Request] = []
    recent: list[str] = []
    t = 0.0
    n_session = 0
    while len(out) < requests:
        t += rng.expovariate(1.0 / burst_gap_mean_s)
        rate = rng.uniform(*burst_rate)
        for _ in range(rng.randint(*burst_size)):
            if len(out) >= requests:
                break
            t += rng.expovariate(rate)
            mt = rng.randint(8, 96)
            msg = "<|user|>" + text.prose(rng.randint(20, 400)) + "\n<|assistant|>"
            if recent and rng.random() < follow_up_frac:
                sid = rng.choice(recent)
                out.append(
                    Request(
                        id=-1,
                        t=round(t, 4),
                        session=sid,
                        continues=sid,
                        text=msg,
                        max_tokens=mt,
                        sampling=_sampling(rng, sampled_frac),
                    )
                )
                continue
            sid = f"c{n_session}"
            n_session += 1
            recent = (recent + [sid])[-30:]
            out.append(
                Request(
                    id=-1,
                    t=round(t, 4),
                    session=sid,
                    text=rng.choice(personas) + msg,
                    max_tokens=mt,
                    sampling=_sampling(rng, sampled_frac),
                )
            )
    return _finish(Header(kind="chat", seed=seed, description=f"{requests} bursty chat requests"), out, [])


def restart(seed: int, *, requests: int = 120, restarts: int = 3, **agent_kw: float) -> Trace:
    """Agent traffic with restarts in the middle: graceful ones after a flush,
    crashes shortly after a flush (the flush must survive), bare crashes."""
    base = agent(seed, requests=requests, **agent_kw)  # type: ignore[arg-type]
    rng = random.Random(seed ^ 0x5EED)
    end = base.duration_s
    controls: list[Event] = []
    for i in range(restarts):
        t = end * (i + 1) / (restarts + 1) + rng.uniform(-0.05, 0.05) * end
        mode = i % 3
        if mode == 0:  # graceful: drain, flush, stop
            controls.append(Restart(t=round(t, 3), crash=False))
        elif mode == 1:  # flush, then a crash a little later
            controls.append(Flush(t=round(t, 3)))
            # late enough for the flush to finish in a pause between turns
            controls.append(Restart(t=round(t + rng.uniform(3.0, 20.0), 3), crash=True))
        else:
            controls.append(Restart(t=round(t, 3), crash=True))
    header = Header(kind="restart", seed=seed, description=f"{requests} agent turns, {restarts} restarts")
    return _finish(header, base.requests, controls)


def _finish(header: Header, requests: list[Request], controls: list[Event]) -> Trace:
    """Order by arrival (continuations after their parent), number the
    requests, and validate."""
    # stable: a continuation never precedes the turn it continues, because its
    # time is later and the sort is stable for equal times
    events: list[Event] = sorted([*requests, *controls], key=lambda e: e.t)
    numbered: list[Event] = []
    n = 0
    for e in events:
        if isinstance(e, Request):
            e = Request(**{f: getattr(e, f) for f in e.__struct_fields__ if f != "id"}, id=n)
            n += 1
        numbered.append(e)
    return validate(header, numbered)


def as_tokens(trace: Trace) -> Trace:
    """The same trace with every prompt as UTF-8 byte ids (the fake GPU's tokenizer)."""
    events: list[Event] = []
    for e in trace.events:
        if isinstance(e, Request) and e.text is not None:
            fields = {f: getattr(e, f) for f in e.__struct_fields__ if f not in ("text", "tokens")}
            e = Request(**fields, tokens=list(e.text.encode()))
        events.append(e)
    return validate(trace.header, events)


GENERATORS: dict[str, Callable[..., Trace]] = {"agent": agent, "chat": chat, "restart": restart}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sims.gen", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=sorted(GENERATORS), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, help="number of requests (default: the generator's)")
    ap.add_argument("--tokens", action="store_true", help="write prompts as UTF-8 byte token ids")
    ap.add_argument("--out", help="output file (default: stdout)")
    args = ap.parse_args(argv)
    kw = {} if args.requests is None else {"requests": args.requests}
    trace = GENERATORS[args.kind](args.seed, **kw)
    if args.tokens:
        trace = as_tokens(trace)
    data = trace.encode()
    if args.out:
        with open(args.out, "wb") as f:
            f.write(data)
        print(
            f"[gen] kind={args.kind} seed={args.seed} requests={len(trace.requests)} duration_s={trace.duration_s:.1f} out={args.out}",
            file=sys.stderr,
        )
    else:
        sys.stdout.buffer.write(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
