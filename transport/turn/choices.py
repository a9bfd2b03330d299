"""``n`` choices of one request: n rows admitted together, one stream.

The n rows carry the same prompt and are admitted in one go, so they open in
the same step and their prefill chunks go through one batched forward
(``MLXBackend._prefill_together``); each draws from its own seed stream
(``_Common.choice_params``). ``ChoiceStream`` merges their deltas into what
the SSE writer and ``collect`` read from a single ``RequestStream``; the
renderers map each delta's ``rid`` to its choice index.
"""

from __future__ import annotations

from typing import Any

import anyio

from ember.api import Engine, RequestStream
from engine.errors import EngineError, InvalidRequest
from engine.types import Delta, SamplingParams, Usage


def rename_param(exc: InvalidRequest, name: str, engine_param: str = "constraint") -> InvalidRequest:
    """An engine error about ``engine_param`` reported under the request's own field."""
    if exc.param == engine_param:
        exc.param = name
    return exc


async def submit_choices(
    engine: Engine, prompt: list[int], params: list[SamplingParams], rename: dict[str, str], ns: str = ""
) -> Any:
    """Admit one row per choice, in cache namespace ``ns``; a single
    ``RequestStream`` when n == 1. ``rename``: engine parameter names reported
    under the request's own (``constraint`` -> ``response_format``)."""
    got: dict[int, RequestStream] = {}

    async def one(i: int, p: SamplingParams) -> None:
        got[i] = await engine.asubmit(prompt, p, ns=ns)

    try:
        if len(params) == 1:
            await one(0, params[0])
        else:
            # Submitted concurrently, the Gateway queues every Admit before the
            # Scheduler's next step, so the n rows open (and prefill) together;
            # one after another, the first would often open alone.
            async with anyio.create_task_group() as tg:
                for i, p in enumerate(params):
                    tg.start_soon(one, i, p)
    except BaseException as exc:
        for s in got.values():
            await s.aclose()
        if isinstance(exc, BaseExceptionGroup):  # the first engine error, as a lone request raises it
            engine_errors = [e for e in _leaves(exc) if isinstance(e, EngineError)]
            if engine_errors:
                exc = engine_errors[0]
        if isinstance(exc, InvalidRequest) and exc.param in rename:
            rename_param(exc, rename[exc.param], exc.param)
        raise exc
    streams = [got[i] for i in range(len(params))]
    return streams[0] if len(streams) == 1 else ChoiceStream(streams)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


class ChoiceStream:
    """Several ``RequestStream``s read as one, in arrival order per choice."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self.rids = [s.rid for s in streams]
        self._next = 0  # round-robin start, so no choice starves the others

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def next_nowait(self) -> Delta | None:
        n = len(self.streams)
        for k in range(n):
            s = self.streams[(self._next + k) % n]
            d = s.next_nowait()
            if d is not None:
                self._next = (self._next + k + 1) % n
                return d
        return None

    async def wait(self, timeout: float) -> bool:
        if any(s.finished for s in self.streams):
            live = [s for s in self.streams if not s.finished]
            if not live:
                return True
        else:
            live = self.streams
        ready = False
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as tg:

                async def one(s: RequestStream) -> None:
                    nonlocal ready
                    if await s.wait(timeout):
                        ready = True
                        tg.cancel_scope.cancel()

                for s in live:
                    tg.start_soon(one, s)
        return ready

    def __aiter__(self) -> ChoiceStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if self.finished:
                raise StopAsyncIteration
            d = self.next_nowait()
            if d is not None:
                return d
            await self.wait(3600.0)

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()

    async def __aenter__(self) -> ChoiceStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def merge_usage(usages: list[Usage | None]) -> Usage | None:
    """One request's usage over its choices: the prompt once, every choice's tokens."""
    got = [u for u in usages if u is not None]
    if not got:
        return None
    first = got[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in got),
        cached_tokens=first.cached_tokens,
        ssd_cached_tokens=first.ssd_cached_tokens,
        speculation=first.speculation,
        cache_miss=first.cache_miss,
    )
