"""Drafter: proposes γ tokens per speculating row, two kinds behind one protocol.

* ``ngram`` — prompt lookup (``engine.speculation.ngram``): no model, no device time.
* a draft model (``engine.speculation.draft_model``) — a smaller model with the target's
  tokenizer and its own cache, run on the engine's device (the same MLX thread
  as the target).

The Scheduler sends each row's committed context as a growing tail
(``Draft.start`` is how much of it the Drafter already has), never the drafts;
the Drafter remembers what it put in its own cache. The two sync cores are in
``actors.drafter_cores`` (with the ``Draft``/``Drafted`` records they take and
return); this module imports them and holds the Drafter's messages and the
actor, which runs a draft model's calls on the device and turns a drafter
fault into a round without drafts.
"""

from __future__ import annotations

import logging
from typing import Any, assert_never

from actors.drafter_cores import Draft, Drafted, DrafterCore, Finished
from actors.messages import Wire
from actors.runtime import Actor
from engine.ports import Clock, Device

log = logging.getLogger("ember.drafter")


# ---------------------------------------------------------------------------
# Messages the Drafter accepts.


class DraftRound(Wire, frozen=True):
    """Scheduler → Drafter (ask), before a step with speculating rows; the reply
    is ``DraftedRound``."""

    drafts: list[Draft]


class Forget(Wire, frozen=True):
    """Scheduler → Drafter: these rows finished; free their context and cache.
    ``finished``: their text, for a drafter that learns across requests (sent
    only to one: ``SpecRounds.learns``)."""

    rids: list[int]
    finished: list[Finished] = []


Inbox = DraftRound | Forget


class DraftedRound(Wire, frozen=True):
    """Drafter → Scheduler: the answer to ``DraftRound`` and the device seconds
    spent drafting (catch-up prefill excluded)."""

    drafted: list[Drafted]
    draft_s: float = 0.0
    catch_up_s: float = 0.0  # feeding draft caches that lagged (a row's first round, or after a hold)
    catch_up_tokens: int = 0  # the tokens that catch-up fed: adaptive γ prices a hold's catch-up per token
    reset: list[int] = []  # rows whose context the Drafter dropped: resend it from 0


# ---------------------------------------------------------------------------
# The actor.


class Drafter(Actor[Inbox]):
    name = "drafter"
    inbox_size = 256

    def __init__(self, core: DrafterCore, device: Device, clock: Clock):
        super().__init__()
        self.core = core
        self.device = device
        self.clock = clock
        self.faults = 0  # failed draft rounds (they degrade to plain decode)

    async def receive(self, msg: Inbox) -> Any:
        match msg:
            case DraftRound():
                return await self._draft(msg.drafts)
            case Forget():
                if msg.finished:
                    self.core.learn(msg.finished)  # host work: a drafter that learns runs no model
                if self.core.on_device:
                    await self.device.run(self.core.forget, msg.rids)  # frees arrays on their thread
                else:
                    self.core.forget(msg.rids)
                return None
            case _:
                assert_never(msg)

    async def _draft(self, drafts: list[Draft]) -> DraftedRound:
        core = self.core
        core.extend(drafts)
        if not core.on_device:
            return DraftedRound(drafted=core.draft(drafts))
        try:
            lagging = core.lagging(drafts)
            t0 = self.clock.now()
            caught = 0
            if lagging:
                caught = await self.device.run(core.catch_up, lagging, cost_s=core.catch_up_cost_s(lagging))
            caught_up, t0 = self.clock.now() - t0, self.clock.now()
            drafted = await self.device.run(core.draft, drafts, cost_s=core.cost_s(drafts))
        except (MemoryError, RuntimeError) as exc:
            # A drafter fault costs this round's drafts, never a request: drop
            # the rows' draft caches (they may be half-updated) and rebuild later.
            rids = [d.rid for d in drafts]
            self.faults += 1
            log.warning("[drafter] draft failed rows=%s: %r", rids, exc)
            await self.device.run(core.forget, rids)
            return DraftedRound(drafted=[Drafted(rid=rid, tokens=[]) for rid in rids], reset=rids)
        return DraftedRound(
            drafted=drafted, draft_s=self.clock.now() - t0, catch_up_s=caught_up, catch_up_tokens=caught or 0
        )
