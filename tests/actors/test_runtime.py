"""The actor runtime: tell/ask, bounded inboxes, failures as values, EngineDead."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from actors.runtime import Actor, InboxFull
from engine.errors import EngineDead, InvalidRequest

pytestmark = pytest.mark.anyio


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


class Boom(msgspec.Struct, frozen=True, tag=True):
    pass


class Bad(msgspec.Struct, frozen=True, tag=True):
    pass


class Echo(Actor[Ping | Boom | Bad]):
    name = "echo"
    inbox_size = 2

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []
        self.gate = anyio.Event()

    async def receive(self, msg):
        match msg:
            case Ping(n=n):
                await self.gate.wait()
                self.seen.append(n)
                return n * 2
            case Bad():
                raise InvalidRequest("bad input", "x")
            case Boom():
                raise RuntimeError("bug")


async def test_ask_replies_and_tell_is_fire_and_forget():
    a = Echo()
    a.gate.set()
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        assert await a.ref.ask(Ping(n=3)) == 6
        a.ref.tell_nowait(Ping(n=4))
        await a.ref.tell(Ping(n=5))
        assert await a.ref.ask(Ping(n=1)) == 2
        assert a.seen == [3, 4, 5, 1]
        a.stop()


async def test_request_error_travels_back_and_actor_survives():
    a = Echo()
    a.gate.set()
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        with pytest.raises(InvalidRequest, match="bad input"):
            await a.ref.ask(Bad())
        assert await a.ref.ask(Ping(n=2)) == 4
        a.stop()


async def test_bounded_inbox_refuses_nowait_instead_of_blocking():
    a = Echo()  # gate closed: the first message is held inside receive
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        a.ref.tell_nowait(Ping(n=1))
        await anyio.wait_all_tasks_blocked()
        a.ref.tell_nowait(Ping(n=2))
        a.ref.tell_nowait(Ping(n=3))
        with pytest.raises(InboxFull):
            a.ref.tell_nowait(Ping(n=4))
        assert a.ref.statistics().tasks_waiting_send == 0
        a.gate.set()
        a.stop()
    assert a.seen == [1, 2, 3]


async def test_crash_fails_queued_asks_with_engine_dead():
    a = Echo()  # gate closed
    results: dict[int, object] = {}

    async def asker(n):
        try:
            results[n] = await a.ref.ask(Ping(n=n))
        except EngineDead as exc:
            results[n] = exc

    async with anyio.create_task_group() as callers:
        with pytest.raises(ExceptionGroup) as crash:
            async with anyio.create_task_group() as tg:
                await tg.start(a.run)
                callers.start_soon(asker, 1)  # held inside receive
                await anyio.wait_all_tasks_blocked()
                a.ref.tell_nowait(Boom())  # crashes the actor after ask 1
                callers.start_soon(asker, 3)  # queued behind the crash
                await anyio.wait_all_tasks_blocked()
                a.gate.set()
        assert crash.group_contains(RuntimeError, match="bug")
    assert results[1] == 2
    assert isinstance(results[3], EngineDead)
    # The actor is gone: new asks fail at once, nobody hangs.
    with pytest.raises(EngineDead):
        await a.ref.ask(Ping(n=1))
    assert a.stopped.is_set()


async def test_stop_fails_asks_still_queued():
    a = Echo()  # gate closed
    outcomes: list[object] = []

    async def asker(n):
        try:
            outcomes.append(await a.ref.ask(Ping(n=n)))
        except EngineDead:
            outcomes.append("dead")

    async with anyio.create_task_group() as callers, anyio.create_task_group() as tg:
        await tg.start(a.run)
        callers.start_soon(asker, 1)
        await anyio.wait_all_tasks_blocked()
        callers.start_soon(asker, 2)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()  # stop the actor while ask 1 is mid-handle and ask 2 queued
    assert sorted(map(str, outcomes)) == ["dead", "dead"]
