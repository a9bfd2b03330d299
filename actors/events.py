"""Facts the Scheduler publishes to every subscriber.

"Idle" is an event, not a poll: anything that must not compete with serving
(tensor writes, idle demotion) advances only between an ``EngineIdle`` and the
next ``EngineBusy``. Subscribers (the ColdTier in its inbox union, the durability
coordinator's ``IdleGate`` directly) accept them.
"""

from __future__ import annotations

from actors.messages import Wire


class EngineBusy(Wire, frozen=True):
    """Scheduler → subscribers: the first work arrived after an idle period."""

    at: float


class EngineIdle(Wire, frozen=True):
    """Scheduler → subscribers: the last row left and nothing is queued."""

    at: float
