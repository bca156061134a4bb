"""Who takes part in a replica group's steps: its place in the latest quorum, the groups the
step's participants are (roster.py), and the events when that changes (run_events/goodput.py
counts the survivors' stall at each loss, and the others' at each join)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from raytrain_lm.trainer.components.journal import Journal
from raytrain_lm.trainer.groups.roster import read_roster
from raytrain_lm.trainer.progress import announce


class Membership:
    def __init__(self, group: int, groups: int):
        self.group, self.groups = group, groups  # this group's index, and the most there may be
        self._participant: int | None = 0  # this group's place in the latest quorum
        self.hands_over: Callable[[], None] | None = None  # the tracker's flush (replicas.py)
        self.participants = 1
        self.seen = 1  # participants at the last committed step
        self.last_commit_t = time.time()
        self.joining = False  # healed from a peer, and no step committed since
        # Who took part in the latest step: their types and hourly prices (roster.py).
        self.types: list[str] = []
        self.prices: list[float] = []
        self.price_seen: float | None = None

    @property
    def participant(self) -> int | None:
        return self._participant

    @participant.setter
    def participant(self, place: int | None) -> None:
        if self._participant == 0 and place != 0 and self.hands_over is not None:
            # A chief that hands over stores what it logged before the next step's collectives:
            # the next chief logs the steps its store lacks, and must not find one of these
            # still on its way there (it would log it twice).
            self.hands_over()
        self._participant = place

    @property
    def is_chief(self) -> bool:
        return self.participant == 0

    def formed(self, place: tuple[int | None, int]) -> None:
        self.participant, self.participants = place

    def committed(self, step: int, journal: Journal) -> None:
        """An event when the participants changed: the step it showed in, and the gap from
        the previous committed step (each group records what it saw)."""
        now = time.time()
        if self.participants != self.seen:
            journal.event(
                "replicas_changed",
                group=self.group,
                pid=os.getpid(),
                step=step,
                participants=self.participants,
                previous=self.seen,
                gap_s=round(now - self.last_commit_t, 3),
                joined=self.joining,
            )
            announce(
                f"step {step}: {self.participants} replica groups take part (were {self.seen})",
                self.is_chief,
            )
        self.joining = False
        self.seen, self.last_commit_t = self.participants, now

    def note_roster(self, slots: list[float], journal: Journal, step: int) -> None:
        """The step's participants' types; and, when what they cost together changed, an
        event from which goodput prices the segment from then on."""
        self.types, self.prices = read_roster(slots)
        price = sum(self.prices)
        if price != self.price_seen and self.is_chief:
            event = journal.event("replica_price", segment=journal.segment, step=step,
                                  price_per_hour=price, types=self.types)  # fmt: skip
            if journal.events:  # the segment's own chief: its live goodput reads them
                journal.events.append(event)
        self.price_seen = price

    def handover(self) -> dict:
        return {"participants": self.seen, "price_seen": self.price_seen}

    def adopt(self, state: dict) -> None:
        self.seen, self.price_seen = state["participants"], state["price_seen"]
        self.joining = True
