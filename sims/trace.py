"""The trace format: versioned NDJSON of tagged msgspec records.

A trace is one ``header`` line, then ``request``, ``restart`` and ``flush``
lines in arrival order::

    {"type":"header","version":1,"kind":"agent","seed":7}
    {"type":"request","id":0,"t":0.0,"session":"s0","text":"You are ...","max_tokens":64}
    {"type":"request","id":1,"t":9.5,"session":"s0","continues":"s0","text":"\\n<tool>ok</tool>","max_tokens":64}
    {"type":"flush","t":30.0}
    {"type":"restart","t":31.0,"crash":true}

A request's prompt is ``text`` or ``tokens``; with ``continues: S`` it is the
previous turn of session S (that turn's prompt plus the output it got) followed
by this one. The output is only known when the trace runs, so the same trace
replays on any model: the simulator and the live replayer resolve it with
``Sessions``. A continuation starts at ``max(t, when its parent finished)``.

The simulator and the live replayer read the same files; ``validate`` says
what is wrong with a trace and on which line, rather than failing mid-run.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO

import msgspec

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line."""


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Generation settings of a request (greedy by default). ``seed`` makes a
    sampled request reproducible, so its tokens can be checked too."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False


class Header(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True, tag="header"):
    """The first line: the format version and where the trace came from."""

    version: int = TRACE_VERSION
    kind: str = "custom"
    seed: int | None = None
    description: str = ""


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True, tag="request"):
    """One completion request arriving ``t`` seconds after the trace starts."""

    id: int
    t: float
    session: str
    max_tokens: int
    text: str | None = None
    tokens: list[int] | None = None
    continues: str | None = None  # a session: its previous turn (prompt + output) comes first
    sampling: Sampling = Sampling()

    @property
    def is_text(self) -> bool:
        return self.text is not None


class Restart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="restart"):
    """Restart the server at ``t``: ``crash`` kills it (no drain, no flush;
    unsynced writes are dropped or torn), otherwise it drains, flushes and stops."""

    t: float
    crash: bool = True
    down_s: float = 2.0  # how long the server stays down


class Flush(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True, tag="flush"):
    """Ask the server to make its prompt cache durable at ``t``."""

    t: float


Record = Header | Request | Restart | Flush
Event = Request | Restart | Flush

_decoder = msgspec.json.Decoder(Record)
_encoder = msgspec.json.Encoder()


@dataclass
class Trace:
    header: Header
    events: list[Event] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [e for e in self.events if isinstance(e, Request)]

    @property
    def duration_s(self) -> float:
        return self.events[-1].t if self.events else 0.0

    def parents(self) -> dict[int, int]:
        """For each continuing request id, the id of the turn it continues."""
        last: dict[str, int] = {}
        out: dict[int, int] = {}
        for e in self.events:
            if isinstance(e, Request):
                if e.continues is not None:
                    out[e.id] = last[e.continues]
                last[e.session] = e.id
        return out

    def encode(self) -> bytes:
        return b"".join(_encoder.encode(r) + b"\n" for r in [self.header, *self.events])

    def write(self, path: str | os.PathLike[str]) -> None:
        with open(path, "wb") as f:
            f.write(self.encode())


def validate(header: Header, events: Iterable[Event], lines: list[int] | None = None) -> Trace:
    """Check what the replayers rely on; raise ``TraceError`` naming the line."""
    events = list(events)
    lines = lines or list(range(2, len(events) + 2))
    if header.version != TRACE_VERSION:
        raise TraceError(f"line 1: trace version {header.version} is not supported (this reader knows {TRACE_VERSION})")
    ids: set[int] = set()
    kind_of_session: dict[str, bool] = {}  # session -> is_text of its last turn
    prev_t = 0.0
    for line, e in zip(lines, events):
        where = f"line {line}"
        if not (e.t >= 0.0) or e.t == float("inf"):
            raise TraceError(f"{where}: time {e.t} must be finite and >= 0")
        if e.t < prev_t:
            raise TraceError(f"{where}: time {e.t} goes back (previous {prev_t}); records must be in arrival order")
        prev_t = e.t
        if isinstance(e, Restart) and e.down_s < 0:
            raise TraceError(f"{where}: down_s must be >= 0")
        if not isinstance(e, Request):
            continue
        if e.id in ids:
            raise TraceError(f"{where}: request id {e.id} is used twice")
        ids.add(e.id)
        if (e.text is None) == (e.tokens is None):
            raise TraceError(f"{where}: a request has exactly one of text or tokens")
        if e.tokens is not None and any(t < 0 for t in e.tokens):
            raise TraceError(f"{where}: token ids must be >= 0")
        if e.max_tokens < 1:
            raise TraceError(f"{where}: max_tokens must be >= 1")
        if e.continues is not None:
            if e.continues not in kind_of_session:
                raise TraceError(f"{where}: continues session {e.continues!r}, which has no earlier turn")
            if kind_of_session[e.continues] != e.is_text:
                raise TraceError(f"{where}: a continuation mixes text and token prompts (session {e.continues!r})")
        elif not e.text and not e.tokens:
            raise TraceError(f"{where}: the prompt is empty")
        kind_of_session[e.session] = e.is_text
    return Trace(header, events)


def iter_records(f: IO[bytes]) -> Iterator[tuple[int, Record]]:
    for n, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        try:
            yield n, _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise TraceError(f"line {n}: {exc}") from None


def loads(data: bytes | str) -> Trace:
    if isinstance(data, str):
        data = data.encode()
    return _parse(io.BytesIO(data))


def read(path: str | os.PathLike[str]) -> Trace:
    with open(path, "rb") as f:
        return _parse(f)


def _parse(f: IO[bytes]) -> Trace:
    records = iter_records(f)
    first = next(records, None)
    if first is None:
        raise TraceError("the trace is empty (it needs a header line)")
    n, header = first
    if not isinstance(header, Header):
        raise TraceError(f"line {n}: the first record must be the header, not {type(header).__name__.lower()}")
    events: list[Event] = []
    lines: list[int] = []
    for n, rec in records:
        if isinstance(rec, Header):
            raise TraceError(f"line {n}: a second header")
        events.append(rec)
        lines.append(n)
    return validate(header, events, lines)


def bundled(name: str) -> Trace:
    """A trace committed under ``sims/traces`` (``agent-small`` etc.)."""
    from importlib import resources

    ref = resources.files("sims") / "traces" / f"{name}.ndjson"
    if not ref.is_file():
        have = sorted(p.name.removesuffix(".ndjson") for p in (resources.files("sims") / "traces").iterdir())
        raise TraceError(f"no bundled trace {name!r} (have: {', '.join(have)})")
    return loads(ref.read_bytes())


# ---------------------------------------------------------------------------
# Resolving prompts at run time.


class Sessions:
    """What each turn's prompt is, once the turns it continues have run.

    ``prompt(req)`` joins the parent turn's prompt and output with this turn;
    ``done(req, prompt, output)`` records what a turn produced. Works in text
    space (text prompts, text output) or token space (token prompts, and text
    prompts too when ``encode`` turns text into tokens), never mixing them.
    """

    def __init__(self, trace: Trace, encode: Callable[[str], list[int]] | None = None):
        self.encode = encode
        self.parent = trace.parents()
        self.context: dict[int, list[int] | str] = {}  # request id -> prompt + output
        # Contexts of long agent sessions are large: keep one only until its
        # last continuation has read it.
        self._readers: dict[int, int] = {}
        for p in self.parent.values():
            self._readers[p] = self._readers.get(p, 0) + 1

    def prompt(self, req: Request) -> list[int] | str:
        own: list[int] | str
        if req.text is not None:
            own = self.encode(req.text) if self.encode is not None else req.text
        else:
            own = list(req.tokens or [])
        if req.continues is None:
            return own
        parent = self.parent[req.id]
        before = self.context[parent]
        self._readers[parent] -= 1
        if not self._readers[parent]:
            del self.context[parent]
        return before + own  # type: ignore[operator]  # same kind, checked by validate

    def needed(self, req_id: int) -> bool:
        """Whether a later turn still continues this one."""
        return bool(self._readers.get(req_id))

    def done(self, req: Request, prompt: list[int] | str, output: list[int] | str) -> None:
        if self._readers.get(req.id):
            self.context[req.id] = prompt + output  # type: ignore[operator]
