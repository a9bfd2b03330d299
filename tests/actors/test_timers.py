"""The step watchdog (actors.timers): a deadline per device call, on the
virtual-time loop. The engine-level check (a hung GPU step kills the engine at
its deadline only) is tests/ember/test_engine.py."""

from __future__ import annotations

import anyio
import pytest

from actors.timers import Watchdog
from engine.errors import EngineDead
from engine.ports import LoopClock

pytestmark = pytest.mark.anyio


async def test_calls_under_their_deadline_never_trip_it_and_a_hung_one_dies_at_its_deadline():
    wd = Watchdog(1.0, LoopClock(), what="GPU step")
    done: list[int] = []
    hung_at: list[float] = []

    async def loop() -> None:
        for n in range(1, 4):  # 3 x 0.6 s: far past 1 s in all, under it per call
            with wd.armed(n, 0.6):
                await anyio.sleep(0.6)
            done.append(n)
        hung_at.append(anyio.current_time())
        with wd.armed(4, 0.6):
            await anyio.sleep(60)  # hangs
        done.append(4)

    with pytest.raises(EngineDead, match=r"GPU step 4 hung past 1.0s"):
        await wd.run(loop)
    assert done == [1, 2, 3]
    assert anyio.current_time() == pytest.approx(hung_at[0] + 1.0)


async def test_a_timeout_the_call_raises_itself_is_reported_as_a_hang():
    """As before the watchdog moved into the runtime: a TimeoutError out of a
    device call, with or without a deadline, is the call hanging."""
    for timeout in (None, 5.0):
        wd = Watchdog(timeout, LoopClock(), what="GPU step")

        async def loop() -> None:
            with wd.armed(7, 0.0):
                raise TimeoutError

        with pytest.raises(EngineDead, match=rf"GPU step 7 hung past {timeout}s"):
            await wd.run(loop)


async def test_a_device_whose_calls_take_exactly_their_cost_gets_no_timer_when_it_fits():
    wd = Watchdog(1.0, LoopClock(), exact_cost=True)
    timers: list[object] = []

    async def loop() -> None:
        with wd.armed(1, 0.5):  # ends well before its deadline: no timer
            timers.append(wd._timer)
        with wd.armed(2, 5.0):  # might run past it: a timer
            timers.append(wd._timer)
        timers.append(wd._timer)  # cancelled when the call ended

    await wd.run(loop)
    assert timers[0] is None and timers[1] is not None and timers[2] is None
