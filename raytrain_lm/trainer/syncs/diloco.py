"""`parallel.sync: diloco` for replica groups: DiLoCo (Douillard et al., arXiv 2311.08105) through
torchft's `DiLoCo`, on the same Manager and Lighthouse as every-step replica groups
(replicas.py).

A round is H = `diloco.sync_every` steps of the global order (fewer at the run's end). Each
group takes its share of every one of them (shares of G over the round's P participants, as
every-step groups do) with its own inner AdamW steps and no communication; then the outer
sync: a quorum, the pseudo-gradients (the weights at the round's start minus each group's
now) averaged over the participants, the outer Nesterov SGD step on the round's start weights
(torchft's fragment: prepare_sync, perform_sync). The round's losses, a checksum of the
positions each group took and who took part travel in one more reduction beside it.

Exactly once. Every quorum is a sync. A round commits only when the groups that trained took
exactly the round's positions, each once (the summed checksum): then its H steps count as
trained, go into the ledger and advance the run. A group lost during the round breaks the
checksum; every group then votes not to commit, torchft puts the round's start weights back,
and the same positions are trained again, in the same order, by the groups of the new quorum.
The survivors never restart; what a lost group took is trained by whoever takes part. What
this costs: the survivors' inner steps of that round, and their inner AdamW moments keep
those steps (only the weights go back). A group that joins (or, behind, is healed) at a sync
takes part in it with nothing trained and a zero pseudo-gradient; the average is scaled to
one over the groups that trained, and the round commits for everyone.

Streaming DiLoCo (`diloco.fragments` = F > 1, diloco_parts.py): the commit unit is K =
`diloco.full_sync_every` rounds. Inside it each fragment syncs alone, in turn, every H steps
(H/F apart), on the unit's quorum; the unit ends in a sync of every fragment with the checks
above. A failed fragment sync, or a group lost anywhere in the unit, and the unit does not
commit: every group puts back the weights and outer optimizers of the unit's start (kept in
memory, and sent to a group that heals) and the new quorum trains the unit again. Groups join
only at a unit's end. With one fragment a unit is a round, as above.

The round is the unit of the run's duties: logging, evaluation, checkpoints and the stop and
spot-notice checks happen after a committed round (their cadences are met by the first round
end at or past each multiple), when every group holds the same weights. Bytes handed to the
collectives are counted (`comm/bytes_sent`, `comm/bytes_per_token`) for both sync modes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed import ReduceOp

from raytrain_lm.errors import UserError
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.components.cadence import Cadences, Flags
from raytrain_lm.trainer.components.step import (
    StepParts,
    accumulate_gradients,
    apply_update,
    step_seed,
)
from raytrain_lm.trainer.groups import torchft_adapter
from raytrain_lm.trainer.groups.replicas import ReplicaWorker
from raytrain_lm.trainer.groups.roster import SLOTS_PER_PARTICIPANT, position_checksum, roster_slots
from raytrain_lm.trainer.progress import announce
from raytrain_lm.trainer.syncs.diloco_parts import (
    CountingManager,
    InnerAndOuter,
    UnitStart,
    model_fragments,
    unit_schedule,
)

if TYPE_CHECKING:
    from raytrain_lm.trainer.ray_side import RaySide
    from raytrain_lm.trainer.spec import WorkerSpec


class DilocoWorker(ReplicaWorker):
    """A replica group that syncs every `diloco.sync_every` steps (module docstring)."""

    def __init__(self, spec: WorkerSpec, ray_side: RaySide, rank: int, world: int, t_start):
        super().__init__(spec, ray_side, rank, world, t_start)
        settings = spec.config.diloco
        if settings.quantize and self.device.type != "cuda":
            raise UserError("diloco.quantize needs CUDA (torchft's fused fp8 kernels)")
        self.sync_every = settings.sync_every
        streaming = settings.fragments > 1
        # A commit unit: the rounds between two syncs of the whole model (diloco_parts.py).
        self.unit_steps = self.sync_every * (settings.full_sync_every if streaming else 1)
        fragments = model_fragments(self.model, settings.fragments)
        # One outer SGD per fragment: a fragment's sync steps only its own parameters.
        self.outer_optimizers = [
            torch.optim.SGD(
                fragment.parameters(),
                lr=settings.outer_lr,
                momentum=settings.outer_momentum,
                nesterov=settings.outer_momentum > 0,
            )
            for fragment in fragments
        ]
        self.fragments: list = []  # torchft's, built on the Manager (_on_manager)
        self.unit_start: UnitStart | None = None
        self.model_fragments = fragments
        self.outer_scale = 1.0
        self.joined_round: tuple[list[float], int, int] | None = None
        for outer in self.outer_optimizers:
            outer.register_step_pre_hook(self._scale_outer_gradients)
        self.every = _round_cadences(self.every)
        self.outer_steps = 0
        self.weight_syncs = 0.0  # the whole model's worth of pseudo-gradients all-reduced
        self.leaves_after_round = False  # this group said at the sync that it leaves
        self.quorum_stale = False  # groups left since the last quorum (a spot notice)

    def _on_manager(self, manager) -> None:
        """torchft's DiLoCo, made before the first quorum: it registers each fragment's start
        weights and outer optimizer with the Manager, so that a group joining at a sync heals
        them too."""
        from torchft.local_sgd import DiLoCo

        settings = self.cfg.diloco
        self.diloco = DiLoCo(
            CountingManager(manager, self.quorum.bytes),
            self.model_fragments,
            self.optimizer,
            self.outer_optimizers,
            sync_every=self.sync_every,
            backup_device=self.device,
            pin_memory=False,
            # One flat all-reduce per sync, not one per parameter tensor: over a slow link each
            # all-reduce pays the round trips (docs/benchmarks.md: 2.7 s against 0.7 s a sync
            # of 27 tensors at 50 ms); the bytes are the same.
            use_bucketization=True,
            should_quantize=settings.quantize,
        )
        torchft_adapter.check_diloco(self.diloco)
        self.fragments = torchft_adapter.diloco_fragments(self.diloco)
        if settings.fragments > 1:  # one fragment: its own saved weights are the round's start
            self.unit_start = UnitStart(self.model, self.outer_optimizers, self.fragments, manager)

    @property
    def checkpointed_optimizer(self) -> InnerAndOuter:
        return InnerAndOuter(self.optimizer, self.outer_optimizers)

    def restore(self, offered) -> None:
        """Joins the first quorum (super) and takes part in its sync with nothing trained:
        every quorum is a sync, so that every group of it reduces the same values. At a fresh
        start nobody trained and nothing commits; a group that joins others at the end of
        their round (healed from them) commits their round with them, and does that round's
        duties in the loop's first pass, as they do (`_take_step`)."""
        super().restore(offered)
        if self.quorum is None:  # the run was done before this group started
            return
        if self.healed_at is None:  # restored from a checkpoint (or the seed)
            self._unit_committed()
        else:  # the peer's weights mid-round: contribute none of them
            self._contribute_nothing()
        if not hasattr(self, "seen_participants"):  # start() sets them; a commit here needs them
            self.seen_participants = self.participants
        self.last_commit_t = time.time()
        for cadence in (self.every.log, self.every.eval, self.every.checkpoint):
            cadence._last_step = self.state.step
        if self.state.step < self.end_step:
            summed, committed, first, length = self._sync(None, None, [], 0.0, trained=False)
            if committed:
                self.joined_round = (summed, first, length)

    def _share_flags(self) -> Flags:
        """A spot notice is acted on only as this group announced it at a sync (`_sync`), so
        that the others planned the next round without it; a stop was agreed at the sync."""
        return Flags(ask=self.leaves_after_round, stop=self.stop_seen)

    def _read_pending(self) -> dict[str, float]:
        metrics = super()._read_pending()
        # What one sync costs the link: the number to hold against a link's bandwidth and H.
        metrics["comm/bytes_per_outer_step"] = self.quorum.bytes.sent / max(1, self.weight_syncs)
        return metrics

    def _checkpoint_now(self) -> None:
        """A checkpoint outside a sync (the Lighthouse lost, too few groups): the weights of
        the last committed round, to which the run's step and position belong."""
        self._roll_back()
        super()._checkpoint_now()

    # ------------------------------------------------------------------------------ rounds

    def _take_step(self, parts: StepParts, batches) -> None:
        """One commit unit: its inner steps (with Streaming DiLoCo, single fragments synced
        among them), then the sync of the whole model; taken again until it commits."""
        if self.joined_round is not None:  # committed with the others as this group joined
            summed, first, length = self.joined_round
            self.joined_round = None
            self._commit_round(summed, first, length, waited=0.0)
            self._read_from_here()
            return
        cfg = self.cfg
        while True:
            first = self.state.step
            # After groups left (a spot notice), the unit's quorum still counts them: a single
            # round, whose sync forms the quorum without them.
            unit = self.sync_every if self.quorum_stale else self.unit_steps
            length = min(unit, self.end_step - first)
            schedule = unit_schedule(length, self.sync_every, len(self.fragments))
            plan, p = self._plan(), self.participant
            assert p is not None, "a group that healed takes part"
            self.plan = plan
            step_parts = replace(parts, plan=plan, rank=p)
            mine = slice(plan.offset(p), plan.offset(p) + plan.shares[p])
            losses, norms, taken = [], [], []
            waited, clean = 0.0, True
            if schedule:
                self._forget_last_verdict()
            for i in range(length):
                started = self.tick = time.perf_counter()
                positions, tokens = next(batches)
                waited += time.perf_counter() - started
                torch.manual_seed(step_seed(cfg.training.seed, first + i, p))
                losses.append(accumulate_gradients(step_parts, tokens[mine]))
                norm, _ = apply_update(step_parts, self._lr(first + i))
                norms.append(norm)
                taken.append(positions[mine].copy())
                self.watchdog.beat()
                if self.participants > 1:  # a death at a sync someone else sees (chaos.py)
                    chaos.maybe_fire(
                        self.spec.fault,
                        "kill-in-round",
                        first + i + 1,
                        self.group,
                        self.run_dir,
                        from_step_on=True,
                    )
                self.pacer.pace(started)  # slow-steps: every inner step (chaos.py)
                if i + 1 in schedule:
                    clean = self._sync_fragments(schedule[i + 1])
                    if not clean:  # a group gone, or the link failed: the unit is lost
                        break
            stop = float(self.is_chief and self._stop_due())
            healed_before = self.healed_at
            summed, committed, first, length = self._sync(losses, norms, taken, stop, clean, length)
            self.watchdog.beat()
            healed = self.healed_at != healed_before  # it was behind: now where they are
            if committed:
                break
            self._event(
                "round_retaken", group=self.group, step=first, participants=self.participants
            )
            announce(
                f"steps {first + 1}-{first + length} did not commit (a group was lost): "
                f"{self.participants} group(s) take them again",
                self.is_chief,
            )
            batches = self._read_from_here()
        self._commit_round(summed, first, length, waited)
        if healed:
            self._read_from_here()

    def _read_from_here(self):
        """The data stream from the run's step now (a round retaken, a heal)."""
        self.batches.seek(self.state.step)
        return self.batches

    def _sync(self, losses, norms, taken, stop, clean=True, length=0, trained=True):
        """The sync at the end of this group's unit: a quorum, the pseudo-gradients of every
        fragment averaged (torchft's fragments), and beside them the unit's losses, the
        checksum of the positions taken, how many groups trained, the stop flag, who trained
        (roster.py), whether each trainer's fragment syncs inside the unit all committed, and
        the unit's length. It commits when the groups that trained took the unit's positions
        exactly once and all their syncs committed; the average, over everyone in the quorum
        (torchft's), is then scaled to one over those that trained (a group that joined at
        this sync sent zeros). Every group of the quorum decides alike. A group healed by this
        quorum (it was behind) trained nothing the others did: it takes part as a joiner.
        Returns the summed values, whether the unit committed, its first step and length."""
        g, u = self.cfg.training.global_batch_size, self.unit_steps
        trained_as, healed_before = self.participant, self.healed_at
        if trained:  # else the quorum restore() just formed, which the others are in
            self.participant, self.participants = self.quorum.form()
            self.quorum_stale = False
        # A spot notice that came by now (also while waiting for the quorum) is announced at
        # this sync, so that the next unit is planned without this group.
        leaving = trained and self._drained()
        if self.healed_at != healed_before:
            self._contribute_nothing()
            trained = False
        first = self.state.step
        if not trained:
            losses = norms = [torch.zeros((), device=self.device)] * u
            taken, stop, leaving, clean, length = [], 0.0, False, False, 0
        pad = [0.0] * (u - len(losses))
        checksum = position_checksum(np.concatenate(taken)) if taken else [0.0] * 3
        roster = (
            roster_slots(trained_as, self.groups, self.types[0], self.my_price)
            if trained
            else [0.0] * SLOTS_PER_PARTICIPANT * self.groups
        )
        leavers = [0.0] * self.groups  # by place in this quorum: who leaves after this unit
        leavers[self.participant] = float(leaving)
        stored, written = self._chief_wrote()
        host = [
            *checksum, float(trained), stop, stored, written, *roster, *leavers, float(clean),
            length,
        ]  # fmt: skip
        values = torch.cat(
            [
                torch.stack(losses).double().reshape(-1),
                torch.tensor(pad, dtype=torch.float64, device=self.device),
                torch.stack(norms).double().reshape(-1).to(self.device),
                torch.tensor([*pad, *host], dtype=torch.float64, device=self.device),
            ]
        )
        manager = self.quorum.manager
        self.quorum.bytes.add(values)
        # First, and alone: whether anyone trained (at a fresh start nobody has, and the
        # weights' all-reduce is skipped by every group alike).
        manager.allreduce(values, reduce_op=ReduceOp.SUM).wait()
        summed = values.tolist()
        trainers = summed[2 * u + 3]
        if manager.errored() is not None or trainers < 1:
            # The reduction failed (its values are not to be trusted), or nobody trained.
            manager.report_error(RuntimeError("nothing to commit at this sync"))
            manager.should_commit()
            if trained:
                self._roll_back()
            return summed, False, first, length
        length = round(summed[-1] / trainers)  # a joiner knows it from those who trained
        wanted = position_checksum(np.arange(first * g, (first + length) * g, dtype=np.int64))
        if summed[2 * u : 2 * u + 3] != wanted or round(summed[-2]) != round(trainers):
            # Every group sees the same sums and skips the weights' all-reduce alike: over a
            # slow link a unit known to be lost would cost a model's worth of bytes more.
            manager.report_error(RuntimeError("the unit's positions were not all taken once"))
            manager.should_commit()
            self._roll_back()
            return summed, False, first, length
        self.weight_syncs += 1
        for fragment in self.fragments:  # all in flight before any is waited for
            fragment.prepare_sync()
        self.outer_scale = self.participants / trainers
        committed = all([fragment.perform_sync() for fragment in self.fragments])
        if not committed:
            self._roll_back()
        elif self.unit_start is not None:
            self.unit_start.take()
        return summed, committed, first, length

    def _sync_fragments(self, ids: list[int]) -> bool:
        """Single fragments synced inside a unit (Streaming DiLoCo), on the quorum of the
        unit's start, which every group of the unit trains in: a group that joins waits for the
        unit's end, and a group lost makes the all-reduce fail. Whether each committed: if not,
        the unit is lost for this group (the sync at its end tells the others)."""
        self.outer_scale = 1.0
        for index in ids:
            self.fragments[index].prepare_sync()
        self.weight_syncs += len(ids) / len(self.fragments)
        committed = all([self.fragments[index].perform_sync() for index in ids])
        self._pin_manager_step()
        return committed

    def _forget_last_verdict(self) -> None:
        """A unit's fragment syncs use the quorum of the sync before it, where torchft's Manager
        still holds that sync's error if it did not commit (only a new quorum clears it: every
        all-reduce and commit would fail until then). A failure of that quorum's process
        groups is still reported: the Manager asks them at each commit."""
        torchft_adapter.forget_failed_sync(self.quorum.manager)

    def _unit_committed(self) -> None:
        """This point is a sync of the whole model: what a unit that fails goes back to."""
        for fragment in self.fragments:
            fragment.save_parameters()
        if self.unit_start is not None:
            self.unit_start.take()

    def _roll_back(self) -> None:
        """The weights (with fragments, also the outer optimizers) of the last full sync."""
        if self.unit_start is None:
            self.fragments[0].restore_parameters()
        else:
            self.unit_start.put_back()
        self._pin_manager_step()

    def _contribute_nothing(self) -> None:
        """Healed from a peer in the middle of its unit: each fragment's weights set to those
        of its last sync, so that this group's pseudo-gradients are zero."""
        for fragment in self.fragments:
            fragment.restore_parameters()

    def _pin_manager_step(self) -> None:
        """The Manager's step is the run's committed step (a fragment's sync inside a unit
        advanced it): the quorum heals a group that is behind by comparing those."""
        manager = self.quorum.manager
        manager.load_state_dict(
            {"step": self.state.step, "batches_committed": manager.batches_committed()}
        )

    def _scale_outer_gradients(self, *_args) -> None:
        """The outer optimizer's step pre-hook: torchft's average over the quorum, made one
        over the groups that trained; and the configured outer settings, which a checkpoint's
        or a peer's optimizer state would otherwise bring back."""
        settings = self.cfg.diloco
        groups = [group for outer in self.outer_optimizers for group in outer.param_groups]
        for group in groups:
            group["lr"], group["momentum"] = settings.outer_lr, settings.outer_momentum
            group["nesterov"] = settings.outer_momentum > 0
        if self.outer_scale != 1.0:
            for group in groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(self.outer_scale)

    def _commit_round(self, summed: list[float], first: int, length: int, waited: float):
        """A committed round's bookkeeping, the same in every group of the quorum: the run
        advances by its steps, its positions go into the ledger, its steps' summed losses into
        the metrics; the Manager's step follows the run's, as with every-step sync (a group
        that restores a checkpoint, or heals, compares those)."""
        cfg, state, u = self.cfg, self.state, self.unit_steps
        g = cfg.training.global_batch_size
        trainers = max(1, round(summed[2 * u + 3]))
        self.outer_steps += 1
        self._note_membership(first + length)
        self.stop_seen = summed[2 * u + 4] > 0
        self._confirm(summed[2 * u + 5], summed[2 * u + 6])  # what the chief's writes hold
        roster = summed[2 * u + 7 :]
        self._note_roster(roster[: SLOTS_PER_PARTICIPANT * trainers])
        slots = SLOTS_PER_PARTICIPANT * self.groups
        self._plan_without_leavers(roster[slots : slots + self.groups])
        for i in range(length):
            state.step += 1
            state.tokens += self.tokens_per_step
            state.position += g
            if cfg.training.ledger:
                self.ledger.append(np.arange((state.step - 1) * g, state.step * g, dtype=np.int64))
            metrics = {
                "train/lr": self._lr(first + i),
                "progress/tokens": state.tokens,
                "replicas/participants": trainers,
                "diloco/outer_step": self.outer_steps,
            }
            loss = torch.tensor(summed[i], device=self.device)
            norm = torch.tensor(summed[u + i] / trainers, device=self.device)
            self.pending.add(state.step, loss, norm, metrics, waited if i == 0 else 0.0)
        self._pin_manager_step()

    def _drained(self) -> bool:
        """Whether this group's node is being drained (a spot notice), asked on the cadence of
        `fault.preemption_check_s` (one request to Ray's control plane)."""
        if not self.every.signals.due(self.state.step, self.end_step):
            return False
        return self.ray.draining_deadline_ms(self.ray.node_id()) is not None

    def _ends_group(self, flags: Flags) -> bool:
        """As for every-step groups; and a group the others planned out leaves even if its
        notice was withdrawn meanwhile: they no longer count on it."""
        if super()._ends_group(flags):
            return True
        if self.leaves_after_round:
            self.leaving = True
            return True
        return False

    def _plan_without_leavers(self, leavers: list[float]) -> None:
        """After a committed round, the groups that announced a spot notice leave (after its
        duties) and the others plan the next round without them: their places in the quorum
        close up, so the next sync, which the leavers miss, finds every position taken. A
        leaver is chief no more (the next chief writes the round's checkpoint). When every
        group leaves, nobody replans: the chief checkpoints as the last group would."""
        leaving = [i for i in range(self.participants) if leavers[i] > 0]
        if not leaving or self.participant is None:
            return
        if len(leaving) == self.participants:  # the chief ends the run as the last group does
            self.leaves_after_round = True
            if self.is_chief:
                self.participants = 1
            else:
                self.participant = None
            return
        if self.participant in leaving:
            self.leaves_after_round, self.participant = True, None
            return
        staying = [i for i in range(self.participants) if i not in leaving]
        self.quorum_stale = True
        self.participant, self.participants = staying.index(self.participant), len(staying)


def _round_cadences(every: Cadences) -> Cadences:
    """Log, evaluation and checkpoint at the first round end at or past each multiple."""
    for cadence in (every.log, every.eval, every.checkpoint):
        cadence.crossing = True
    return every
