"""Rounds between replica groups (`parallel.sync=diloco` or `local_sgd`): each group trains H =
`diloco.sync_every` steps of the global order alone, then the groups sync their weights.

A round is H steps (fewer at the run's end). Each group takes its share of every one of them
(shares of G over the round's P participants, as every-step groups do) with its own inner
AdamW steps and no communication; then the sync: a quorum, the weights' exchange (the outer
update: outer_update.py's DiLoCo or LocalSGD), and beside it one more reduction (`RoundSums`)
with the round's losses, a checksum of the positions each group took and who took part.

Exactly once. Every quorum is a sync. A round commits only when the groups that trained took
exactly the round's positions, each once (the summed checksum): then its H steps count as
trained, go into the ledger and advance the run. A group lost during the round breaks the
checksum; every group then votes not to commit, puts the round's start weights back, and the
same positions are trained again, in the same order, by the groups of the new quorum. The
survivors never restart; what a lost group took is trained by whoever takes part. A group that
joins (or, behind, is healed) at a sync takes part in it with nothing trained; the exchange is
scaled to one over the groups that trained, and the round commits for everyone.

Streaming DiLoCo (`diloco.fragments` = F > 1, diloco_parts.py): the commit unit is K =
`diloco.full_sync_every` rounds. Inside it each fragment syncs alone, in turn, every H steps
(H/F apart), on the unit's quorum; the unit ends in a sync of every fragment with the checks
above. A failed fragment sync, or a group lost anywhere in the unit, and the unit does not
commit: every group goes back to the unit's start and the new quorum trains it again. Groups
join only at a unit's end. With one fragment a unit is a round.

The round is the unit of the run's duties: logging, evaluation, checkpoints and the stop and
spot-notice checks happen after a committed round (their cadences are met by the first round
end at or past each multiple), when every group holds the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.components.cadence import Cadences, Flags
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.state import StepRecord
from raytrain_lm.trainer.components.step import accumulate_gradients, apply_update, step_seed
from raytrain_lm.trainer.groups.replicas import ReplicaGroup
from raytrain_lm.trainer.groups.roster import SLOTS_PER_PARTICIPANT, position_checksum, roster_slots
from raytrain_lm.trainer.groups.sums import Packer
from raytrain_lm.trainer.progress import announce
from raytrain_lm.trainer.syncs.diloco_parts import unit_schedule
from raytrain_lm.trainer.syncs.leavers import Leavers
from raytrain_lm.trainer.syncs.outer_update import OuterUpdate


@dataclass
class RoundSums:
    """What the groups of a sync sum beside the weights' exchange."""

    losses: Any  # each inner step's loss parts (a device vector when packed; padded)
    norms: Any  # each inner step's gradient norms
    checksum: list[float]  # of the positions the groups took (roster.position_checksum)
    trainers: float  # groups that trained the unit (a joiner did not)
    stop: float  # the chief's stop flag: 0, or its reason's code (chief_stops.py)
    stored: float  # the chief's store holds every step up to this - 1 (chief.py; 0: unknown)
    written: float  # the chief's ledger is written through this step - 1 (0: unknown)
    roster: list[float]  # each trainer's type and price, at its place when it trained
    leavers: list[float]  # by place in this quorum: who leaves after this unit (a spot notice)
    clean: float  # trainers whose fragment syncs inside the unit all committed
    length: float  # the unit's steps, as each trainer took them


@dataclass
class Unit:
    """A unit as this group trained it (nothing, for a group that joins at its sync)."""

    first: int
    length: int = 0
    losses: list[torch.Tensor] | None = None
    norms: list[torch.Tensor] | None = None
    taken: list[np.ndarray] | None = None
    clean: bool = True
    waited: float = 0.0

    @property
    def trained(self) -> bool:
        return self.losses is not None


class Rounds:
    def __init__(self, parts: LoopParts, group: ReplicaGroup, outer: OuterUpdate):
        self.parts, self.group, self.outer = parts, group, outer
        settings = parts.cfg.diloco
        self.sync_every = settings.sync_every
        # A commit unit: the rounds between two syncs of the whole model (diloco_parts.py).
        self.unit_steps = self.sync_every * (settings.full_sync_every if outer.fragments > 1 else 1)
        self.leavers = Leavers(group)
        self.outer_steps = 0
        self.joined_unit: tuple[RoundSums, Unit] | None = None
        groups = group.members.groups
        self.packer = Packer(
            RoundSums, losses=self.unit_steps, norms=self.unit_steps, checksum=3,
            roster=SLOTS_PER_PARTICIPANT * groups, leavers=groups,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ the loop's

    @property
    def optimizer_state(self):
        return self.outer.checkpointed_optimizer(self.parts.trainee.optimizer)

    def on_manager(self, manager) -> None:
        self.outer.on_manager(manager, self.group.quorum.bytes)

    def cadences(self, every: Cadences) -> Cadences:
        """Log, evaluation and checkpoint at the first round end at or past each multiple."""
        for cadence in (every.log, every.eval, every.checkpoint):
            cadence.crossing = True
        return every

    def flags(self, group: ReplicaGroup, step: int) -> Flags:
        """Not the group's own: a spot notice is acted on only as this group announced it at a
        sync, so that the others planned the next unit without it (leavers.py asks Ray, on the
        `signals` cadence); a stop was agreed at the sync."""
        return Flags(ask=self.leavers.leaves_after_round, stop=self.group.stop_seen)

    def ends(self, ends: bool) -> bool:
        """A group the others planned out leaves even if its notice was withdrawn meanwhile:
        they no longer count on it."""
        if not ends and self.leavers.leaves_after_round:
            self.group.leaving = True
            return True
        return ends

    def metrics(self) -> dict[str, float]:
        # What one sync costs the link: the number to hold against a link's bandwidth and H.
        sent = self.group.quorum.bytes.sent if self.group.quorum is not None else 0
        return {"comm/bytes_per_outer_step": sent / max(1, self.outer.weight_syncs)}

    def before_emergency_checkpoint(self) -> None:
        """A checkpoint outside a sync (the Lighthouse lost, too few groups): the weights of
        the last committed unit, to which the run's step and position belong."""
        self.roll_back()

    def after_join(self) -> None:
        """Takes part in the first quorum's sync with nothing trained: every quorum is a sync,
        so that every group of it reduces the same values. At a fresh start nobody trained
        and nothing commits; a group that joins others at the end of their unit (healed from
        them) commits that unit with them, and does its duties in the loop's first pass, as
        they do."""
        group, parts = self.group, self.parts
        if group.quorum is None:  # the run was done before this group started
            return
        if group.healing.healed:  # the peer's weights mid-unit: contribute none of them
            self.outer.contribute_nothing()
        else:  # restored from a checkpoint (or the seed)
            self.outer.unit_committed()
        group.members.last_commit_t = time.time()
        for cadence in (parts.every.log, parts.every.eval, parts.every.checkpoint):
            cadence.count_from(parts.progress.step)
        if parts.progress.step < parts.end_step:
            summed, unit, committed = self._sync(Unit(parts.progress.step), joining=True)
            if committed:
                self.joined_unit = (summed, unit)

    # ------------------------------------------------------------------------------ units

    def advance(self) -> list[StepRecord]:
        """One commit unit: its inner steps (with Streaming DiLoCo, single fragments synced
        among them), then the sync of the whole model; taken again until it commits."""
        if self.joined_unit is not None:  # committed with the others as this group joined
            (summed, unit), self.joined_unit = self.joined_unit, None
            records = self._commit(summed, unit)
            self.parts.batches.seek(self.parts.progress.step + len(records))
            return records
        while True:
            unit = self._train_unit()
            healed_before = self.group.healing.healed_at
            summed, unit, committed = self._sync(unit)
            self.parts.watchdog.beat()
            healed = self.group.healing.healed_at != healed_before  # was behind: now with them
            if committed:
                break
            self._retake(unit)
        records = self._commit(summed, unit)
        if healed:
            self.parts.batches.seek(self.parts.progress.step + len(records))
        return records

    def _train_unit(self) -> Unit:
        parts, group, members = self.parts, self.group, self.group.members
        first = parts.progress.step
        # After groups left (a spot notice), the unit's quorum still counts them: a single
        # round, whose sync forms the quorum without them.
        steps = self.sync_every if self.leavers.quorum_stale else self.unit_steps
        unit = Unit(first, min(steps, parts.end_step - first), [], [], [])
        schedule = unit_schedule(unit.length, self.sync_every, self.outer.fragments)
        place = members.participant
        assert place is not None, "a group that healed takes part"
        plan = parts.trainee.plan = group.step.shares_plan()
        step_parts = replace(parts.step_parts, plan=plan, rank=place)
        mine = slice(plan.offset(place), plan.offset(place) + plan.shares[place])
        if schedule:
            self.outer.forget_last_verdict()
        for i in range(unit.length):
            started = time.perf_counter()
            positions, tokens = next(parts.batches)
            unit.waited += time.perf_counter() - started
            torch.manual_seed(step_seed(parts.cfg.training.seed, first + i, place))
            unit.losses.append(accumulate_gradients(step_parts, tokens[mine]))
            norm, _ = apply_update(step_parts, parts.trainee.lr(first + i))
            unit.norms.append(norm)
            unit.taken.append(positions[mine].copy())
            if members.participants > 1:  # a death at a sync someone else sees (chaos.py)
                chaos.maybe_fire(parts.spec.fault, "kill-in-round", first + i + 1,
                                  group.group, parts.run_dir, from_step_on=True)  # fmt: skip
            parts.after_step(started)  # slow-steps: every inner step (chaos.py)
            if i + 1 in schedule:
                unit.clean = self.outer.sync_fragments(schedule[i + 1])
                self.pin_manager_step()
                if not unit.clean:  # a group gone, or the link failed: the unit is lost
                    break
        return unit

    def _retake(self, unit: Unit) -> None:
        group, members = self.group, self.group.members
        self.parts.journal.event("round_retaken", group=group.group, step=unit.first,
                                 participants=members.participants)  # fmt: skip
        announce(
            f"steps {unit.first + 1}-{unit.first + unit.length} did not commit (a group was "
            f"lost): {members.participants} group(s) take them again",
            group.is_chief,
        )
        self.parts.batches.seek(self.parts.progress.step)

    def _sync(self, unit: Unit, joining: bool = False) -> tuple[RoundSums, Unit, bool]:
        """The sync at the end of this group's unit: a quorum, the exchange of the weights,
        and beside it the `RoundSums`. It commits when the groups that trained took the unit's
        positions exactly once and all their syncs committed; every group of the quorum
        decides alike. A group healed by this quorum (it was behind) trained nothing the others
        did: it takes part as a joiner. `joining`: the quorum the group's join formed, which
        the others are in."""
        group, members, parts = self.group, self.group.members, self.parts
        trained_as, healed_before = members.participant, group.healing.healed_at
        # The chief of the unit just trained says whether a stop was requested.
        stop = 0.0 if joining else group.stop_due()  # the chief's, with its reason
        if not joining:
            members.formed(group.quorum.form())
            self.leavers.quorum_stale = False
        # A spot notice that came by now (also while waiting for the quorum) is announced at
        # this sync, so that the next unit is planned without this group.
        leaving = not joining and self.leavers.drained(parts)
        if group.healing.healed_at != healed_before:
            self.outer.contribute_nothing()
            unit = Unit(parts.progress.step)
        summed = self._reduce(unit, trained_as, leaving, stop)
        manager = group.quorum.manager
        if manager.errored() is not None or summed.trainers < 1:
            # The reduction failed (its values are not to be trusted), or nobody trained.
            self._vote_no("nothing to commit at this sync", roll_back=unit.trained)
            return summed, unit, False
        unit.length = round(summed.length / summed.trainers)  # a joiner learns it so
        g = parts.cfg.training.global_batch_size
        span = np.arange(unit.first * g, (unit.first + unit.length) * g, dtype=np.int64)
        if summed.checksum != position_checksum(span) or round(summed.clean) != round(
            summed.trainers
        ):
            # Every group sees the same sums and skips the weights' exchange alike: over a
            # slow link a unit known to be lost would cost a model's worth of bytes more.
            self._vote_no("the unit's positions were not all taken once", roll_back=True)
            return summed, unit, False
        committed = self.outer.sync_all(members.participants / summed.trainers)
        if not committed:
            self.roll_back()
        return summed, unit, committed

    def _reduce(self, unit: Unit, trained_as: int | None, leaving: bool, stop: float) -> RoundSums:
        group, members, parts, u = self.group, self.group.members, self.parts, self.unit_steps
        device, groups = parts.device, members.groups
        zeros = [torch.zeros((), device=device)] * u
        losses, norms = (unit.losses, unit.norms) if unit.trained else (zeros, zeros)
        pad = torch.zeros(u - len(losses), dtype=torch.float64, device=device)
        leavers = [0.0] * groups
        leavers[members.participant] = float(leaving and unit.trained)
        stored, written = group.chief_wrote()
        sums = RoundSums(
            losses=torch.cat([torch.stack(losses).double().reshape(-1), pad]),
            norms=torch.cat([torch.stack(norms).double().reshape(-1).to(device), pad]),
            checksum=position_checksum(np.concatenate(unit.taken)) if unit.taken else [0.0] * 3,
            trainers=float(unit.trained),
            stop=stop if unit.trained else 0.0,
            stored=stored,
            written=written,
            roster=roster_slots(trained_as, groups, parts.trainee.where.types[0], group.my_price)
            if unit.trained
            else [0.0] * SLOTS_PER_PARTICIPANT * groups,
            leavers=leavers,
            clean=float(unit.trained and unit.clean),
            length=float(unit.length if unit.trained else 0),
        )
        values = self.packer.pack(sums, device)
        group.quorum.bytes.add(values)
        # First, and alone: whether anyone trained (at a fresh start nobody has, and the
        # weights' exchange is skipped by every group alike).
        group.quorum.manager.allreduce(values, reduce_op=ReduceOp.SUM).wait()
        return self.packer.unpack(values)

    def _vote_no(self, why: str, roll_back: bool) -> None:
        manager = self.group.quorum.manager
        manager.report_error(RuntimeError(why))
        manager.should_commit()
        if roll_back:
            self.roll_back()

    def roll_back(self) -> None:
        self.outer.roll_back()
        self.pin_manager_step()

    def pin_manager_step(self) -> None:
        """The Manager's step is the run's committed step (a fragment's sync inside a unit
        advanced it): the quorum heals a group that is behind by comparing those."""
        manager = self.group.quorum.manager
        manager.load_state_dict(
            {"step": self.parts.progress.step, "batches_committed": manager.batches_committed()}
        )

    def _commit(self, summed: RoundSums, unit: Unit) -> list[StepRecord]:
        """A committed unit's records, the same in every group of the quorum: its steps, their
        positions for the ledger, their summed losses; the Manager's step follows the run's
        (a group that restores a checkpoint, or heals, compares those)."""
        group, members, parts = self.group, self.group.members, self.parts
        trainers, g = max(1, round(summed.trainers)), parts.cfg.training.global_batch_size
        self.outer_steps += 1
        members.committed(unit.first + unit.length, parts.journal)
        group.stop_seen = group.stops.seen(summed.stop)
        group.confirm(summed.stored, summed.written)  # what the chief's writes hold
        members.note_roster(summed.roster[: SLOTS_PER_PARTICIPANT * trainers], parts.journal,
                            unit.first)  # fmt: skip
        self.leavers.plan_without(summed.leavers)
        records = []
        for i in range(unit.length):
            step = unit.first + i
            span = np.arange(step * g, (step + 1) * g, dtype=np.int64)
            records.append(StepRecord(
                lr=parts.trainee.lr(step),
                loss=torch.tensor(summed.losses[i], device=parts.device),
                grad_norm=torch.tensor(summed.norms[i] / trainers, device=parts.device),
                positions=span if parts.cfg.training.ledger else None,
                data_wait_s=unit.waited if i == 0 else 0.0,
                metrics={"replicas/participants": trainers, "diloco/outer_step": self.outer_steps},
            ))  # fmt: skip
        manager = group.quorum.manager
        manager.load_state_dict(
            {"step": unit.first + unit.length, "batches_committed": manager.batches_committed()}
        )
        return records
