"""A replica group's part in an every-step sync (syncs/every_step.py).

Exactly once, whoever takes part. Step s is positions [s*G, (s+1)*G) of the global order.
Each group reads the whole step and, after the quorum, takes its slice by participating place
(shares of G over the P participants, by type weight or declared speed where
`scaling.balance` asks: speeds.py). Each pass's loss is weighted by P*b/G and torchft averages
the gradients over the P participants, so the update is the mean over the step's tokens, as
with any fixed split. The participants then sum their loss parts with a checksum of the
positions they took (`StepSums`), and vote; a step that does not commit is taken again, with
the same positions, by the next quorum. A committed step's positions go into the ledger only
after its checksum showed that the participants took each of them exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raytrain_lm.trainer.components.balance import type_weights
from raytrain_lm.trainer.components.batch_plan import BatchPlan, share_metrics
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.state import Settled
from raytrain_lm.trainer.components.step import StepParts
from raytrain_lm.trainer.groups import interval
from raytrain_lm.trainer.groups.roster import (
    SLOTS_PER_PARTICIPANT,
    check_step_taken,
    position_checksum,
    roster_slots,
)
from raytrain_lm.trainer.groups.speeds import DeclaredSpeed, agreed_weights, declared_speeds
from raytrain_lm.trainer.groups.sums import Packer
from raytrain_lm.trainer.progress import announce

if TYPE_CHECKING:
    from raytrain_lm.trainer.groups.replicas import ReplicaGroup


@dataclass
class StepSums:
    """What the participants of a step sum beside its gradients."""

    loss: Any  # their parts of the step's mean loss (a device scalar when packed)
    checksum: list[float]  # of the positions each took (roster.position_checksum)
    stop: float  # the chief's stop flag: 0, or its reason's code (chief_stops.py)
    stored: float  # the chief's store holds every step up to this - 1 (chief.py; 0: unknown)
    written: float  # the chief's ledger is written through this step - 1 (0: unknown)
    roster: list[float]  # each participant's type and price, in its slots (roster.py)
    interval: list[float]  # the chief's new checkpoint interval, if it chose one (interval.py)


def step_packer(participants: int) -> Packer[StepSums]:
    return Packer(
        StepSums,
        checksum=3,
        roster=SLOTS_PER_PARTICIPANT * participants,
        interval=interval.SLOTS,
    )


class ReplicaStep:
    def __init__(self, group: ReplicaGroup, parts: LoopParts):
        self.group, self.parts = group, parts
        self.quorum_formed = False  # the quorum of the group's start serves its first step
        self.whole_step: tuple[int, np.ndarray, np.ndarray] | None = None
        self.plan: BatchPlan | None = None
        clock, tolerance = parts.trainee.clock, parts.cfg.scaling.balance_tolerance
        self.speed = DeclaredSpeed(clock, tolerance) if clock is not None else None  # auto
        self.declarations: list[float] = []  # the participants' sum of them, this step
        self.members_seen: tuple[int, ...] = ()  # the groups of the last committed plan
        self.shares: tuple[int, ...] = ()  # and their shares

    def begin(self, step: int) -> tuple[StepParts, int]:
        """A quorum (healing first if this group is behind), then this step's shares over its
        participants; returns the step parts and this group's place (the dropout seed's)."""
        group, parts = self.group, self.parts
        if not self.quorum_formed:
            group.members.formed(group.quorum.form())
        self.quorum_formed = False
        if parts.progress.step != step:  # healed from a peer that was ahead: read from there on
            group.healing.adopt_throughput()
            parts.batches.seek(parts.progress.step)
        place = group.members.participant
        assert place is not None, "a group that healed takes part"
        # The trainee's plan is what checkpoints and the summary report.
        self.plan = parts.trainee.plan = self.shares_plan()
        return replace(parts.step_parts, plan=self.plan, rank=place), place

    def take(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This group's slice of the step (the whole step is read once, however many times
        the step is taken)."""
        step = self.parts.progress.step
        if self.whole_step is None or self.whole_step[0] != step:
            positions, tokens = next(self.parts.batches)
            self.whole_step = (step, positions.copy(), tokens)
        place, plan = self.group.members.participant, self.plan
        mine = slice(plan.offset(place), plan.offset(place) + plan.shares[place])
        _, positions, tokens = self.whole_step
        return positions[mine], tokens[mine]

    def exchange(self, model: torch.nn.Module, loss: torch.Tensor, taken: np.ndarray) -> StepSums:
        """The participants' gradients averaged and their sums, in one reduction (quorum.py)."""
        group, members = self.group, self.group.members
        stored, written = group.chief_wrote()
        sums = StepSums(
            loss=loss.reshape(1),
            checksum=position_checksum(taken),
            stop=group.stop_due(),  # the chief's, with its reason
            stored=stored,
            written=written,
            roster=roster_slots(
                members.participant,
                members.participants,
                self.parts.trainee.where.types[0],
                group.my_price,
            ),  # fmt: skip
            interval=group.interval.sums(),
        )
        packer = step_packer(members.participants)
        summed = group.quorum.reduce_step(model, packer.pack(sums, self.parts.device))
        return packer.unpack(summed)

    def settle(self, summed: StepSums) -> Settled:
        """A committed step: checked taken exactly once, the chief's word passed on, who took
        part noted."""
        group, parts, members = self.group, self.parts, self.group.members
        step, g = parts.progress.step, self.plan.global_batch
        check_step_taken(step, g, summed.checksum)
        group.confirm(summed.stored, summed.written)  # what the chief's writes hold
        members.committed(step + 1, parts.journal)
        group.stop_seen = group.stops.seen(summed.stop)
        group.interval.settle(summed.interval, parts.every.checkpoint)
        members.note_roster(summed.roster, parts.journal, step + 1)
        if self.speed is not None:
            self._settle_speeds()
        positions = np.arange(step * g, (step + 1) * g, dtype=np.int64)
        return Settled(
            loss=torch.tensor(summed.loss, device=parts.device),
            positions=positions if parts.cfg.training.ledger else None,
            metrics={"replicas/participants": members.participants},
        )

    def shares_plan(self) -> BatchPlan:
        """This step's shares of the global batch over its participants: equal, by the
        participants' type weights, or by their declared speeds (`scaling.balance`)."""
        members, cfg, parts = self.group.members, self.parts.cfg, self.parts
        place, participants = members.participant, members.participants
        weights = None
        if self.speed is not None:
            self.speed.before_step(parts.progress.step)
            summed = self._sum(self.speed.slots(place, participants, self.group.group))
            weights = agreed_weights(summed, participants)
            self.declarations = summed  # in use once the step commits (_settle_speeds)
        elif isinstance(cfg.scaling.balance, dict):
            vector = [0.0] * participants
            vector[place] = type_weights(cfg.scaling.balance, parts.trainee.where.types)[0]
            summed = self._sum(vector)
            if all(w > 0 for w in summed):  # else the reduction failed: no commit anyway
                weights = summed
        return BatchPlan.derive(cfg.training, participants, weights or [1.0] * participants)

    def _sum(self, values: list[float]) -> list[float]:
        vector = torch.tensor(values, dtype=torch.float64, device=self.parts.device)
        return self.group.quorum.sum(vector).tolist()

    def _settle_speeds(self) -> None:
        """A committed step's plan: this group measures its share anew if it changed, and the
        chief records a plan that new declarations changed among the same groups (one that
        members changed is the replicas_changed event's). Only a committed step's sums are
        the participants' (a failed reduction leaves a group its own vector)."""
        parts, plan, step = self.parts, self.plan, self.parts.progress.step
        participants = plan.world_size
        self.speed.agreed_share(step, plan.shares[self.group.members.participant])
        speeds, ids = declared_speeds(self.declarations, participants)
        shares_before, ids_before = self.shares, self.members_seen
        self.shares, self.members_seen = plan.shares, ids
        if plan.shares == shares_before or ids != ids_before:
            return
        parts.tracker.log_metrics(share_metrics(plan), step=step)
        if self.group.is_chief:
            rates = [None if s is None else round(s, 2) for s in speeds]
            parts.journal.event("batch_plan", step=step, reason="measured", groups=list(ids),
                                shares=list(plan.shares), passes=list(plan.passes),
                                sequences_per_s=rates)  # fmt: skip
            announce(f"balance at step {step} (sequences/s declared by the groups {rates}): "
                     f"{plan.describe()}")  # fmt: skip
