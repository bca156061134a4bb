"""`scaling.fault_tolerance=replicas`: a lost, drained or added node changes who takes part in
the next step, and the others never stop.

Every Ray Train worker is a replica group of its own (Ray Train's `TorchftConfig`, which runs
torchft's Lighthouse on the head and replaces a failed group alone). Before every step the
group's torchft `Manager` forms a quorum with the live groups (quorum.py): a group that is lost
is left out after `replicas.heartbeat_timeout_s`; a group that joins (a replacement, capacity
come back) heals from a live peer (healing.py) and takes part in that same step. Only when no
group is alive (the first start, or all lost) does a group restore the run's newest checkpoint,
which stays the backstop.

Exactly once, whoever takes part (replica_step.py): the participants split step s's positions
and check the split in the step's sums; a step that does not commit is taken again.

Who writes: the lowest participating place of the latest quorum is the chief (metrics, events,
heartbeats, checkpoints, ledger); every group keeps what the chief needs (chief.py), so whoever
becomes chief next logs from where the last one stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from raytrain_lm import devices
from raytrain_lm.checkpoints import TrainState, latest_complete_checkpoint, read_state
from raytrain_lm.data import ledger
from raytrain_lm.data.stream import StepStream, WorkerSlice
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.journal import Heartbeat
from raytrain_lm.tracking import MLflowTracker, NullTracker
from raytrain_lm.trainer.checkpointing.chief_uploads import ChiefUploads
from raytrain_lm.trainer.checkpointing.resume import restore_newest
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.batch_plan import BatchPlan
from raytrain_lm.trainer.components.cadence import Flags
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.components.state import Settled
from raytrain_lm.trainer.components.trainee import Trainee, where_in_group
from raytrain_lm.trainer.groups.chief import ChiefProgress, ChiefTracker
from raytrain_lm.trainer.groups.chief_stops import ChiefStops
from raytrain_lm.trainer.groups.feed import open_stream
from raytrain_lm.trainer.groups.healing import Healing, committed_since
from raytrain_lm.trainer.groups.interval import IntervalAgreement
from raytrain_lm.trainer.groups.membership import Membership
from raytrain_lm.trainer.groups.quorum import LIGHTHOUSE_ENV, LighthouseLost, Quorum, TooFewReplicas
from raytrain_lm.trainer.groups.replica_step import ReplicaStep
from raytrain_lm.trainer.groups.start import record_start, start_metrics
from raytrain_lm.trainer.progress import announce
from raytrain_lm.trainer.spec import WorkerSpec

# A chief's heartbeat (every 0.5 s) younger than this says where the groups training are.
HEARTBEAT_FRESH_S = 10.0


class ReplicaGroup:
    def __init__(self, spec: WorkerSpec, ray, rank: int, world: int):
        self.spec, self.ray = spec, ray
        self.members = Membership(rank, world)
        self.rank, self.world = 0, 1  # a process group of one worker: DDP has nothing to do
        self.fault_rank = rank  # the group a chaos test's fault names (chaos.py)
        self.quorum: Quorum | None = None  # made as the group joins
        self.healing = Healing(self)
        self.stop_seen = False  # the chief saw a stop request, and the step said so
        self.leaving = False  # a spot notice: this group leaves the others
        self.regular_read = False  # whether the loop's read now is one every group makes
        self.upload_deadline: float | None = None  # a spot notice's (wall clock)
        self.parts: LoopParts | None = None
        self.started = False  # joined, restored or healed, and recorded its start (start)

    # ------------------------------------------------------------------------------ who

    @property
    def group(self) -> int:
        return self.members.group

    @property
    def is_chief(self) -> bool:
        return self.members.is_chief

    @property
    def speaks_for_run(self) -> bool:
        """The chief's metrics and progress go out, except at a read it makes only because it
        leaves the others (a spot notice): the next chief logs those steps at its next read.
        At a read every group makes (log, eval, checkpoint steps) the others drop theirs."""
        members = self.members
        leaving_alone = self.leaving and members.participants > 1 and not self.regular_read
        return members.is_chief and not leaving_alone

    def build_trainee(self, spec: WorkerSpec, device: torch.device) -> Trainee:
        where = where_in_group(self.ray, 0, 1, device, chief=True, needs_nodes=False)
        trainee = Trainee(spec.config, spec.data_dir, device, where, spec.checkpoint_strategy)
        if trainee.strategy != "ddp":
            raise UserError("scaling.fault_tolerance=replicas trains with parallel.strategy=ddp")
        return trainee

    def tracker(self) -> ChiefTracker:
        tracking, speaks = self.spec.tracking, lambda: self.speaks_for_run
        inner = MLflowTracker(tracking.uri, tracking.run_id) if tracking else NullTracker()
        return ChiefTracker(inner, speaks, self.spec.fault, self.spec.run_dir)

    def attach(self, parts: LoopParts) -> None:
        self.parts = parts
        self.members.hands_over = parts.tracker.flush
        cfg = parts.cfg
        market, types = self.ray.node_market(), parts.trainee.where.types
        self.my_price = devices.price_per_hour(cfg.fault.price_per_hour, types[0], market) or 0.0
        self.stops = ChiefStops(cfg, parts.run_dir, types[0], self.my_price)
        self.budget = self.stops if self.stops.projections is not None else None  # the chief's
        self.interval = IntervalAgreement(parts.run_dir)  # checkpoint.every_steps=auto
        self.step = ReplicaStep(self, parts)
        self.uploads = ChiefUploads(self.spec.reports)
        # What a step looks like with every group there (evaluation's batch, the first log).
        groups = self.members.groups
        parts.trainee.plan = BatchPlan.derive(cfg.training, groups, [1.0] * groups)

    def progress_bar(self) -> ChiefProgress | None:
        parts = self.parts
        if not parts.cfg.training.progress:
            return None
        return ChiefProgress(lambda: self.speaks_for_run, parts.end_step, parts.progress.step,
                             parts.cfg.training.log_every)  # fmt: skip

    def data_stream(self, step: int | None = None) -> StepStream:
        """Every group reads whole steps (token ids are small) and takes its slice by place."""
        whole = WorkerSlice(0, 1, self.parts.cfg.training.global_batch_size)
        return StepStream(partial(open_stream, self.parts, whole),
                          self.parts.progress.step if step is None else step)  # fmt: skip

    # ------------------------------------------------------------------------------ joining

    def join(self, prepare, on_manager) -> bool:
        """Joins the first quorum: heals from a live peer if there is one ahead, else (no
        group has trained yet in this invocation) restores the run's newest checkpoint.

        Everything a step needs is made, and the data stream's first batch read, before this
        group's Manager exists (its heartbeats make it known to the Lighthouse): a group that
        joins then takes its first step as soon as it has healed, and the others, who wait
        for its part of that step, do not wait for it to start. `on_manager`: what the sync
        builds on the group's Manager before its first quorum (DiLoCo). False: nothing to join
        (the others finished before this group started)."""
        parts = self.parts
        latest = latest_complete_checkpoint(parts.run_dir)
        restorable = read_state(latest) if latest is not None else TrainState()
        if restorable.step >= parts.end_step:
            parts.progress.restored(restorable)
            return False
        prepare(self._expected_step(restorable.step))
        self.quorum = Quorum(parts.cfg, self.group, parts.device, self.healing.for_peer,
                             self.healing.from_peer)  # fmt: skip
        on_manager(self.quorum.manager)
        self.members.formed(self.quorum.form())
        self.step.quorum_formed = True  # the first step uses this quorum
        if not self.healing.healed:
            restore_newest(parts, rank=0)
            self.quorum.manager.load_state_dict(
                {"step": parts.progress.step, "batches_committed": 0}
            )
            # Groups that restore together (this Lighthouse, this step) are one segment,
            # whichever of them is chief when it starts or ends.
            where = f"{os.environ.get(LIGHTHOUSE_ENV, '')}:{parts.progress.step}"
            parts.journal.segment = hashlib.sha256(where.encode()).hexdigest()[:12]
        parts.journal.restart_throughput(parts.progress.step)
        self.healing.adopt_throughput()
        parts.batches.seek(parts.progress.step)
        return True

    def _expected_step(self, restorable: int) -> int:
        """The step this group will most likely take first: the run's, as its chief's
        heartbeat said a moment ago (other groups train: it heals to about there), else the
        newest checkpoint's (it restores that)."""
        beat = Heartbeat.read(self.parts.run_dir)
        fresh = beat is not None and time.time() - beat.t < HEARTBEAT_FRESH_S
        return beat.step if fresh and beat.step > restorable else restorable

    def start(self) -> None:
        """Records this group's start (its process, whether it healed); the chief of a fresh
        start also records the run's segment as a worker group does."""
        parts, members, healed_at = self.parts, self.members, self.healing.healed_at
        cfg, step = parts.cfg, parts.progress.step
        parts.journal.event(
            "replica_start", group=self.group, pid=os.getpid(), node=self.ray.node_id(),
            step=step, t_start=parts.journal.t_start, healed=healed_at is not None,
            heal_s=round(healed_at - parts.journal.t_start, 2) if healed_at else None,
            participants=members.participants,
            **(self.healing.digest() if cfg.training.ledger and healed_at else {}),
        )  # fmt: skip
        if healed_at is None:
            # What start() reports: the first quorum's size (weights come with the first step).
            participants = members.participants
            parts.trainee.plan = BatchPlan.derive(cfg.training, participants, [1.0] * participants)
            if self.is_chief:
                nodes = sorted(self.ray.alive_node_ids())
                started = record_start(parts, nodes, participants, self.my_price, guard=False)
                _, self.interval.known_interruptions = started
            parts.tracker.log_metrics(start_metrics(parts), step=step)
            members.seen = participants
        else:
            announce(f"replica group {self.group} joined at step {step}, healed from a peer")
        members.last_commit_t = time.time()
        self.started = True  # from here on it has committed state to save (running)

    def rebalancer(self, forced_reads: set[int]) -> None:
        return None  # shares by speed are agreed at every step (speeds.py)

    def forced_reads(self, step: int) -> set[int]:
        # Every group reads at the same steps, so the next chief holds what the last did not log.
        return set()

    # ------------------------------------------------------------------------------ steps

    def begin_step(self, step: int):
        return self.step.begin(step)

    def take(self, step: int):
        return self.step.take(step)

    def exchange(self, model, loss: torch.Tensor, positions):
        return self.step.exchange(model, loss, positions)

    def vote(self) -> bool:
        return self.quorum.commit()

    def settle(self, summed, positions, loss) -> Settled:
        return self.step.settle(summed)

    def stop_due(self) -> float:
        return self.stops.flag(self)  # the chief's word and why; the others keep no account

    # ------------------------------------------------------------------------------ ending

    def flags(self, step: int) -> Flags:
        """Each group looks at its own node on its own clock; a stop was agreed in the step."""
        return Flags(ask=self.parts.every.signals.due(step, self.parts.end_step),
                     stop=self.stop_seen)  # fmt: skip

    def ends(self, flags: Flags) -> bool:
        """A stop ends every group at this step, after the chief's checkpoint. A spot notice
        ends this group alone: it leaves at this step boundary and the others go on; the last
        group checkpoints first, and the driver starts the run again elsewhere."""
        parts, members = self.parts, self.members
        step = parts.progress.step
        if flags.stop:
            if self.is_chief:
                parts.journal.keep(stop_requests.STOP, step=step, why=self.stops.reason)
            announce(f"stop: checkpoint at step {step}, then the run ends", self.is_chief)
            return True
        deadline_ms = self.ray.draining_deadline_ms(self.ray.node_id())
        if deadline_ms is None:
            return False
        self.leave(deadline_ms)
        if members.participants > 1:
            announce(f"spot notice: replica group {self.group} leaves at step {step}")
            return True  # after this step's duties (checkpoint_turn)
        announce(f"spot notice for the last replica group: checkpoint at step {step}")
        parts.journal.keep(stop_requests.PREEMPTION, step=step, deadline_ms=deadline_ms)
        return True

    def leave(self, deadline_ms: int | None) -> None:
        self.leaving = True
        self.upload_deadline = deadline_ms / 1000 if deadline_ms else None
        self.parts.journal.event("replica_drained", group=self.group, step=self.parts.progress.step,
                                 participants=self.members.participants)  # fmt: skip

    @contextlib.contextmanager
    def running(self, emergency_checkpoint) -> Iterator[None]:
        """Around the group's life: once it trains, a Lighthouse lost or too few groups end it
        with a checkpoint (`emergency_checkpoint`) and say why, and every group ends by saying
        whether the groups are done with this invocation (driver/callbacks.py reads it). A
        group that fails before it started has nothing to save: it fails, and Ray Train
        replaces it."""
        parts, lost, too_few = self.parts, False, False
        try:
            yield
        except LighthouseLost as exc:
            if not self.started:
                raise
            # No quorum can form again: the chief checkpoints what the groups committed and
            # the driver starts the run again, with a new Lighthouse (launch.py).
            lost = True
            announce(f"{exc}: checkpoint at step {parts.progress.step}, then a restart",
                     self.is_chief)  # fmt: skip
            if self.is_chief:
                parts.journal.event(stop_requests.LIGHTHOUSE_LOST, step=parts.progress.step)
                emergency_checkpoint()
        except TooFewReplicas as exc:
            if not self.started:
                raise
            # Every group that is left gives up; the last quorum's chief, if it is one of them,
            # checkpoints first (the others cannot tell who is alive: the run then resumes
            # from its newest checkpoint). The driver ends the run with this reason.
            too_few = True
            if self.is_chief:
                emergency_checkpoint()
            parts.journal.event(stop_requests.REPLICAS_TOO_FEW, group=self.group,
                                step=parts.progress.step, reason=str(exc))  # fmt: skip
        self._close(lost, too_few)

    def _close(self, lost: bool, too_few: bool) -> None:
        parts, members = self.parts, self.members
        self.uploads.join()
        if self.leaving and members.participants > 1:
            members.participant = None  # the others go on: it is chief no more (stores first)
        if self.quorum is not None:
            self.quorum.manager.shutdown(wait=False)
        step = parts.progress.step
        ended = step >= parts.end_step or self.stop_seen or self.leaving or lost
        if (self.is_chief and ended) or too_few:  # see callbacks.EndAfterReplicasDone
            parts.journal.event(stop_requests.REPLICAS_DONE, step=step, too_few=too_few)

    # ------------------------------------------------------------------------------ figures

    def roster(self) -> tuple[list[str], list[float]]:
        members, plan = self.members, self.parts.trainee.plan
        if len(members.types) == len(plan.shares):  # the step's (roster.py)
            return members.types, members.prices
        alone = members.participants == 1  # before the first step
        return (self.parts.trainee.where.types, [self.my_price]) if alone else ([], [])

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        """Each group's MFU on its own device (the step's tokens/s over its participants), and
        what it hands the network."""
        parts, trainee = self.parts, self.parts.trainee
        per_group = tokens_per_s / max(1, self.members.participants)
        sent = self.quorum.bytes.sent if self.quorum is not None else 0
        first = parts.journal.throughput.first_step
        trained = max(1, parts.progress.state.tokens - first * trainee.tokens_per_step)
        return {
            "perf/mfu": devices.mfu(trainee.flops_per_token, per_group, parts.device),
            "comm/bytes_sent": sent,
            "comm/bytes_per_token": sent / trained,
        }

    def price_per_hour(self) -> float:
        return sum(self.members.prices) if self.members.prices else self.my_price

    # ------------------------------------------------------------------------------ writing

    def checkpoint_turn(self, final: bool) -> tuple[str, bool]:
        """The chief alone writes the ledger and the checkpoint (every group holds the same
        state) and uploads it itself: replica groups report nothing to Ray Train, whose report
        waits for every worker. ("write" | "forget" | "skip", and whether it is final.)"""
        if self.leaving and self.members.participants > 1:
            # A drained group that leaves the others training does what this step asks of
            # any group (the others have done their part of it: as chief, the periodic
            # checkpoint and ledger if one falls here) and no more.
            if not self.parts.every.checkpoint.last_due:  # this step's periodic checkpoint
                return "skip", False
            final = False
        if not self.is_chief:
            return "forget", final  # the ledger's positions wait for the chief's word (confirm)
        progress = self.parts.progress
        if progress.ledger:
            # A chief that died after writing a ledger file and before the others heard of it
            # left a file that this one's positions, since the last confirmed step, include.
            ledger.discard_after(self.parts.run_dir, progress.last_report_step)
        return "write", final

    interruptions = property(lambda self: self.interval.interruptions())  # read by each chief

    def agree_interval(self, steps: int, since: int) -> None:
        self.interval.propose(steps, since)  # in use once a step carried it (interval.py)

    def chief_wrote(self) -> tuple[float, float]:
        """What the chief tells the others in a step's or a round's sums (the others send 0):
        the last step its tracker stored, and the step its ledger is written through, each
        plus one."""
        if not self.is_chief:
            return 0.0, 0.0
        parts = self.parts
        return float(parts.tracker.stored_through + 1), float(parts.progress.last_report_step + 1)

    def confirm(self, stored: float, written: float) -> None:
        """Forgets what the chief's store and ledger hold (`chief_wrote`'s values summed). A
        group keeps the ledger's positions since the last step the chief confirmed, not since
        its own last checkpoint step: a chief that dies between its log and its checkpoint at
        a checkpoint step writes neither, and the next chief's ledger then starts where the
        dead one's last confirmed file ended."""
        parts = self.parts
        progress = parts.progress
        parts.tracker.confirm(round(stored) - 1)
        through = round(written) - 1
        if through > progress.last_report_step:
            progress.last_report_step = through
            if parts.cfg.training.ledger:
                progress.ledger = committed_since(
                    through, progress.step, parts.cfg.training.global_batch_size
                )

    def publish(self, report: dict[str, float], local: Path | None, wait: bool, upload) -> None:
        if local is not None:
            step = self.parts.progress.step
            self.uploads.publish(local, f"checkpoint_{step:09d}", report, wait, upload)
