"""IdleGate: the per-tensor SSD write gate of the durability coordinator.

"Idle" is an event, not a poll (``actors.events``): the gate is open only
between the Scheduler's ``EngineIdle`` and its next ``EngineBusy``, and every
tensor step of an SSD write awaits ``wait_turn`` first.
"""

from __future__ import annotations

from typing import assert_never

import anyio

from actors.events import EngineBusy, EngineIdle


class IdleGate:
    """The per-tensor write gate: open only between ``EngineIdle`` and ``EngineBusy``.

    Subscribed to the Scheduler directly (it quacks like an ``ActorRef``), so
    it flips in the same instant the Scheduler publishes, before the
    Scheduler's next GPU step starts; an event that first queued in an inbox
    could let one tensor write slip into that step.
    """

    name = "idle-gate"

    def __init__(self) -> None:
        self.busy = False
        self.busy_edges = 0  # idle → busy edges so far: unchanged and not busy = idle all along
        self._idle = anyio.Event()
        self._idle.set()

    def tell_nowait(self, msg: EngineIdle | EngineBusy) -> None:
        match msg:
            case EngineBusy():
                if not self.busy:
                    self.busy = True
                    self.busy_edges += 1
                    self._idle = anyio.Event()
            case EngineIdle():
                self.busy = False
                self._idle.set()
            case _:
                assert_never(msg)

    async def wait_turn(self) -> None:
        while self.busy:
            await self._idle.wait()
