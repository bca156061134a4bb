"""Replica groups (`scaling.fault_tolerance=replicas`): a lost, drained or added node changes
who takes part in the next step, and the others never stop.

Every Ray Train worker is a replica group of its own (Ray Train's `TorchftConfig`, which runs
torchft's Lighthouse on the head and replaces a failed group alone). Before every step the
group's torchft `Manager` forms a quorum with the live groups: a group that is lost is left out
after `replicas.heartbeat_timeout_s`; a group that joins (a replacement, capacity come back)
heals from a live peer through torchft's checkpoint transport (model, optimizer, train state,
ledger position) and takes part in that same step. Only when no group is alive (the first start,
or all lost) does a group restore the run's newest checkpoint, which stays the backstop.

Exactly once, whoever takes part. Step s is positions [s*G, (s+1)*G) of the global order. Each
group reads the whole step (G sequences: token ids are small) and, after the quorum, takes its
slice by participating rank (shares of G over the P participants, by type weight where
`scaling.balance` gives them). Each pass's loss is weighted by P*b/G and torchft averages the
gradients over the P participants, so the update is the mean over the step's tokens, as with
any fixed split. The participants then sum their loss parts with a checksum of the positions
they took, and vote (`should_commit`); a step that does not commit is taken again, with the same
positions, by the next quorum. A committed step's positions go into the ledger only after its
checksum showed that the participants took each of them exactly once.

Who writes: the lowest participating rank of the latest quorum is the chief (metrics, events,
heartbeats, checkpoints, ledger); every group keeps what the chief needs, so whoever becomes
chief next logs from where the last one stopped.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raytrain_lm import devices
from raytrain_lm.checkpoints import TrainState, latest_complete_checkpoint, read_state
from raytrain_lm.data import ledger
from raytrain_lm.data.stream import StepStream, WorkerSlice
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.journal import Heartbeat
from raytrain_lm.tracking.interface import Tracker
from raytrain_lm.trainer import chaos
from raytrain_lm.trainer.checkpointing.chief_uploads import ChiefUploads
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.balance import type_weights
from raytrain_lm.trainer.components.batch_plan import BatchPlan
from raytrain_lm.trainer.components.cadence import Flags
from raytrain_lm.trainer.components.step import (
    StepParts,
    accumulate_gradients,
    apply_update,
    step_seed,
)
from raytrain_lm.trainer.groups.quorum import (
    LIGHTHOUSE_ENV,
    ChiefProgress,
    ChiefTracker,
    LighthouseLost,
    Quorum,
    TooFewReplicas,
)
from raytrain_lm.trainer.groups.roster import (
    SLOTS_PER_PARTICIPANT,
    check_step_taken,
    position_checksum,
    read_roster,
    roster_slots,
)
from raytrain_lm.trainer.progress import ProgressBar, announce
from raytrain_lm.trainer.worker import Worker

if TYPE_CHECKING:
    from raytrain_lm.trainer.ray_side import RaySide
    from raytrain_lm.trainer.spec import WorkerSpec

# A chief's heartbeat (every 0.5 s) younger than this says where the groups training are.
HEARTBEAT_FRESH_S = 10.0


class ReplicaWorker(Worker):
    """A replica group of one worker (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, ray_side: RaySide, rank: int, world: int, t_start):
        self.group, self.groups = rank, world  # this group's index, and the most there may be
        self._participant: int | None = 0  # this group's place in the latest quorum
        self.participants = 1
        super().__init__(spec, ray_side, 0, 1, t_start)  # a process group of one worker
        if self.strategy != "ddp":
            raise UserError("scaling.fault_tolerance=replicas trains with parallel.strategy=ddp")
        self.quorum: Quorum | None = None  # made as the group joins (restore)
        self.healed_at: float | None = None
        self.joining = False  # healed from a peer, and no step committed since
        self.whole_step: tuple[int, np.ndarray, np.ndarray] | None = None
        self.stop_seen = False
        self.leaving = False
        self.regular_read = False  # whether the loop's current read is one every group makes
        self.uploads = ChiefUploads(self._upload, spec.reports)
        # Who took part in the latest step (roster.py): their types and hourly prices.
        self.participant_types: list[str] = []
        self.participant_prices: list[float] = []
        self.price_seen: float | None = None
        self.peer_throughput: dict[str, Any] | None = None  # a healed group's, to adopt

    @property
    def participant(self) -> int | None:
        return self._participant

    @participant.setter
    def participant(self, place: int | None) -> None:
        tracker = getattr(self, "tracker", None)
        if self._participant == 0 and place != 0 and tracker is not None:
            # A chief that hands over stores what it logged before the next step's collectives:
            # the next chief logs the steps its store lacks, and must not find one of these
            # still on its way there (it would log it twice).
            tracker.flush()
        self._participant = place

    @property
    def is_chief(self) -> bool:
        return self.participant == 0

    @property
    def speaks_for_run(self) -> bool:
        """Whether this group's metrics and progress go out: the chief's, except at a read it
        makes only because it is leaving the others to train on (a spot notice): every group
        queued those steps, and the next chief logs them once, at its next read. At a read
        every group makes (log, eval, checkpoint steps) the others drop theirs: it logs."""
        leaving_alone = self.leaving and self.participants > 1 and not self.regular_read
        return self.is_chief and not leaving_alone

    @property
    def fault_rank(self) -> int:
        return self.group

    def _tracker(self) -> Tracker:
        return ChiefTracker(super()._tracker(), self)

    def _progress(self) -> ProgressBar | None:
        if not self.cfg.training.progress:
            return None
        return ChiefProgress(self, self.end_step, self.state.step, self.cfg.training.log_every)

    # ------------------------------------------------------------------------------ peers

    def _for_peer(self) -> dict[str, Any]:
        """What a joining group heals from (torchft sends it from this group)."""
        if self.cfg.training.ledger:  # the run is being verified: say what was sent
            self._event("replica_sent", group=self.group, step=self.state.step, **self._digest())
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "train": asdict(self.state),
            "last_report_step": self.last_report_step,
            "unlogged": self.pending.snapshot(),  # the healed group may be the next chief
            "unstored": self.tracker.handover(),  # logged, maybe not stored: ChiefTracker
            "participants": self.seen_participants,
            "segment": self.segment,  # one worker group's life, for goodput, whoever writes
            "price_seen": self.price_seen,
            "throughput": vars(self.throughput).copy(),  # the summary's, whoever is chief
        }

    def _from_peer(self, state: dict[str, Any]) -> None:
        cut = chaos.find(self.spec.fault, "kill-while-healing")  # a chaos test's
        if cut is not None and state["train"]["step"] >= (cut.step or 0):
            chaos.maybe_fire(cut, "kill-while-healing", cut.step, self.group, self.run_dir)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.state = TrainState(**state["train"])
        self.last_report_step = state["last_report_step"]
        self.ledger = self._committed_since(self.last_report_step, self.state.step)
        self.pending.adopt(state["unlogged"], self.device)
        self.tracker.adopt(state["unstored"])
        self.seen_participants = state["participants"]
        self.segment = state["segment"]
        self.price_seen = state["price_seen"]
        self.peer_throughput = state["throughput"]
        self.healed_at = time.time()
        self.joining = True  # until its first committed step

    def _digest(self) -> dict[str, str]:
        """SHA-256 of the weights and of the optimizer's state, bit for bit."""
        digests = {}
        for name, tensors in (
            ("params_sha", self.model.state_dict().values()),
            ("optim_sha", [v for s in self.optimizer.state.values() for v in s.values()]),
        ):
            digest = hashlib.sha256()
            for tensor in tensors:
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            digests[name] = digest.hexdigest()[:16]
        return digests

    def _chief_wrote(self) -> tuple[float, float]:
        """What the chief tells the others in a step's sums (the others send 0): the last step
        its tracker stored, and the step its ledger is written through, each plus one."""
        if not self.is_chief:
            return 0.0, 0.0
        return float(self.tracker.stored_through + 1), float(self.last_report_step + 1)

    def _confirm(self, stored: float, written: float) -> None:
        """Forgets what the chief's store and ledger hold (`_chief_wrote`'s values summed). A
        group keeps the ledger's positions since the last step the chief confirmed, not since
        its own last checkpoint step: a chief that dies between its log and its checkpoint at
        a checkpoint step writes neither, and the next chief's ledger then starts where the
        dead one's last confirmed file ended."""
        self.tracker.confirm(round(stored) - 1)
        through = round(written) - 1
        if through > self.last_report_step:
            self.last_report_step = through
            if self.cfg.training.ledger:
                self.ledger = self._committed_since(through, self.state.step)

    def _committed_since(self, first: int, end: int) -> list[np.ndarray]:
        g = self.cfg.training.global_batch_size
        return [np.arange(first * g, end * g, dtype=np.int64)] if end > first else []

    # ------------------------------------------------------------------------------ start

    def restore(self, offered) -> None:
        """Joins the first quorum: heals from a live peer if there is one ahead, else (no
        group has trained yet in this invocation) restores the run's newest checkpoint."""
        latest = latest_complete_checkpoint(self.run_dir)
        restorable = read_state(latest) if latest is not None else TrainState()
        if restorable.step >= self.end_step:  # started after the others finished: nothing to join
            self.state = restorable
            return
        # Everything a step needs is made, and the data stream's first batch read, before this
        # group's Manager exists (its heartbeats make it known to the Lighthouse): a group that
        # joins then takes its first step as soon as it has healed, and the others, who wait
        # for its part of that step, do not wait for it to start.
        self._prepare_loop(step=self._expected_step(restorable.step))
        self.quorum = Quorum(self.cfg, self.group, self.device, self._for_peer, self._from_peer)
        self._on_manager(self.quorum.manager)
        self.participant, self.participants = self.quorum.form()
        self.quorum_formed = True  # the first step uses this quorum
        if self.healed_at is None:
            super().restore(offered)
            self.quorum.manager.load_state_dict({"step": self.state.step, "batches_committed": 0})
            # Groups that restore together (this Lighthouse, this step) are one segment,
            # whichever of them is chief when it starts or ends.
            where = f"{os.environ.get(LIGHTHOUSE_ENV, '')}:{self.state.step}"
            self.segment = hashlib.sha256(where.encode()).hexdigest()[:12]
        self.throughput = type(self.throughput)(first_step=self.state.step)
        self._adopt_peer_throughput()
        self.batches.seek(self.state.step)

    def _on_manager(self, manager) -> None:
        """What is built on this group's torchft Manager before its first quorum (DiLoCo)."""

    def _expected_step(self, restorable: int) -> int:
        """The step this group will most likely take first: the run's, as its chief's
        heartbeat said a moment ago (other groups train: it heals to about there), else the
        newest checkpoint's (it restores that)."""
        beat = Heartbeat.read(self.run_dir)
        fresh = beat is not None and time.time() - beat.t < HEARTBEAT_FRESH_S
        return beat.step if fresh and beat.step > restorable else restorable

    def _adopt_peer_throughput(self) -> None:
        if self.peer_throughput is not None:
            vars(self.throughput).update(self.peer_throughput)
            self.peer_throughput = None

    def start(self) -> None:
        """Records this group's start (its process, whether it healed); the chief of a fresh
        start also records the run's segment as a worker group does."""
        if self.state.step >= self.end_step:
            return
        self._event(
            "replica_start",
            group=self.group,
            pid=os.getpid(),
            node=self.ray.node_id(),
            step=self.state.step,
            t_start=self.t_start,
            healed=self.healed_at is not None,
            heal_s=round(self.healed_at - self.t_start, 2) if self.healed_at else None,
            participants=self.participants,
            **(self._digest() if self.cfg.training.ledger and self.healed_at else {}),
        )
        if self.healed_at is None:
            # What start() reports: the first quorum's size (weights come with the first step).
            self.plan = BatchPlan.derive(
                self.cfg.training, self.participants, [1.0] * self.participants
            )
            super().start()
        else:
            announce(
                f"replica group {self.group} joined at step {self.state.step}, healed from a peer"
            )
        self.last_commit_t = time.time()
        if self.healed_at is None:
            self.seen_participants = self.participants

    def train(self) -> None:
        lost = too_few = False
        try:
            if self.state.step < self.end_step:
                super().train()
        except LighthouseLost as exc:
            # No quorum can form again: the chief checkpoints what the groups committed and
            # the driver starts the run again, with a new Lighthouse (launch.py).
            lost = True
            announce(f"{exc}: checkpoint at step {self.state.step}, then a restart", self.is_chief)
            if self.is_chief:
                self._event(stop_requests.LIGHTHOUSE_LOST, step=self.state.step)
                self._checkpoint_now()
        except TooFewReplicas as exc:
            # Every group that is left gives up; the last quorum's chief, if it is one of them,
            # checkpoints first (the others cannot tell who is alive: the run then resumes
            # from its newest checkpoint). The driver ends the run with this reason.
            too_few = True
            if self.is_chief:
                self._checkpoint_now()
            self._event(stop_requests.REPLICAS_TOO_FEW, group=self.group, step=self.state.step,
                        reason=str(exc))  # fmt: skip
        self.uploads.join()
        if self.leaving and self.participants > 1:
            self.participant = None  # the others go on: it is chief no more
        if self.quorum is not None:
            self.quorum.manager.shutdown(wait=False)
        ended = self.state.step >= self.end_step or self.stop_seen or self.leaving or lost
        if (self.is_chief and ended) or too_few:  # see callbacks.EndAfterReplicasDone
            self._event(stop_requests.REPLICAS_DONE, step=self.state.step, too_few=too_few)

    def _checkpoint_now(self) -> None:
        if len(self.pending):
            self.tracker.log_metrics(self._read_pending(), step=self.state.step)
        self._report_checkpoint(final=True)

    # ------------------------------------------------------------------------------ steps

    def _take_step(self, parts: StepParts, batches) -> None:
        """One step, taken again until the participants commit it (see the module docstring)."""
        cfg, state = self.cfg, self.state
        while True:
            before = state.step
            if not getattr(self, "quorum_formed", False):
                self.participant, self.participants = self.quorum.form()
            self.quorum_formed = False
            if state.step != before:  # healed from a peer that was ahead: read from there on
                self._adopt_peer_throughput()
                self.batches.seek(state.step)
            if self.whole_step is None or self.whole_step[0] != state.step:
                waited = time.perf_counter()
                positions, tokens = next(batches)
                self.whole_step = (state.step, positions.copy(), tokens)
                self.data_wait = time.perf_counter() - waited
            self.tick = time.perf_counter()
            assert self.participant is not None, "a group that healed takes part"
            plan, p = self._plan(), self.participant
            mine = slice(plan.offset(p), plan.offset(p) + plan.shares[p])
            _, positions, tokens = self.whole_step
            self.plan = plan  # what the checkpoint and the summary report
            step_parts = replace(parts, plan=plan, rank=p)
            torch.manual_seed(step_seed(cfg.training.seed, state.step, p))
            lr = self._lr(state.step)
            loss = accumulate_gradients(step_parts, tokens[mine])
            taken = positions[mine]
            stop = float(self.is_chief and self._stop_due())
            stored, written = self._chief_wrote()
            roster = roster_slots(p, self.participants, self.types[0], self.my_price)
            host = torch.tensor(
                [*position_checksum(taken), stop, stored, written, *roster], dtype=torch.float64
            )
            values = torch.cat([loss.double().reshape(1), host.to(self.device)])
            # No DDP (a process group of one): the groups' gradients are reduced here.
            sums = self.quorum.reduce_step(self.model, values)
            grad_norm, committed = apply_update(step_parts, lr, self.quorum.commit)
            if committed:
                break
            announce(f"step {state.step + 1} did not commit (a group was lost): taking it again")
        summed = sums.tolist()
        roster = summed[len(summed) - SLOTS_PER_PARTICIPANT * self.participants :]
        global_loss, *checksum, stops, stored, written = summed[: len(summed) - len(roster)]
        check_step_taken(state.step, plan.global_batch, checksum)
        self._confirm(stored, written)
        self._note_membership(state.step + 1)
        self.stop_seen = stops > 0
        state.step += 1
        self._note_roster(roster)
        state.tokens += self.tokens_per_step
        state.position += plan.global_batch
        if cfg.training.ledger:
            g = plan.global_batch
            self.ledger.append(np.arange((state.step - 1) * g, state.step * g, dtype=np.int64))
        metrics = {
            "train/lr": lr,
            "progress/tokens": state.tokens,
            "replicas/participants": self.participants,
        }
        loss_tensor = torch.tensor(global_loss, device=self.device)
        self.pending.add(state.step, loss_tensor, grad_norm, metrics, self.data_wait)
        self.data_wait = 0.0
        self.watchdog.beat()
        self.pacer.pace(self.tick)

    def _note_membership(self, step: int) -> None:
        """An event when the participants changed: the step it showed in, and the gap from
        the previous committed step (the survivors' stall)."""
        now = time.time()
        if self.participants != self.seen_participants:  # each group records what it saw
            self._event(
                "replicas_changed",
                group=self.group,
                pid=os.getpid(),
                step=step,
                participants=self.participants,
                previous=self.seen_participants,
                gap_s=round(now - self.last_commit_t, 3),
                joined=self.joining,
            )
            announce(
                f"step {step}: {self.participants} replica groups take part "
                f"(were {self.seen_participants})",
                self.is_chief,
            )
        self.joining = False
        self.seen_participants, self.last_commit_t = self.participants, now

    def _initial_plan(self) -> BatchPlan:
        # What a step looks like with every group there (evaluation's batch, the first log).
        return BatchPlan.derive(self.cfg.training, self.groups, [1.0] * self.groups)

    def _forced_reads(self) -> set[int]:
        # Every group reads at the same steps (the cadences'), so that whichever becomes
        # chief holds exactly the steps the last chief did not log.
        return set()

    def _batches(self, part=None, step: int | None = None) -> StepStream:
        g = self.cfg.training.global_batch_size
        whole_steps = partial(super()._batches, WorkerSlice(0, 1, g))  # every group reads them
        return StepStream(whole_steps, self.state.step if step is None else step)

    def _roster_of_shares(self) -> tuple[list[str], list[float]]:
        if len(self.participant_types) == len(self.plan.shares):  # the step's (roster.py)
            return self.participant_types, self.participant_prices
        alone = self.participants == 1  # before the first step
        return (self.types, [self.my_price]) if alone else ([], [])

    def _note_roster(self, slots: list[float]) -> None:
        """The step's participants' types; and, when what they cost together changed, an
        event from which goodput prices this segment from then on."""
        self.participant_types, self.participant_prices = read_roster(slots)
        price = sum(self.participant_prices)
        if price != self.price_seen and self.is_chief:
            event = self._event("replica_price", segment=self.segment, step=self.state.step,
                                price_per_hour=price, types=self.participant_types)  # fmt: skip
            if self.events:  # the segment's own chief: its live goodput reads them
                self.events.append(event)
        self.price_seen = price

    def _plan(self) -> BatchPlan:
        """This step's shares of the global batch over its participants: equal, or by the
        participants' type weights (`scaling.balance`)."""
        weights = [1.0] * self.participants
        if isinstance(self.cfg.scaling.balance, dict):
            mine = type_weights(self.cfg.scaling.balance, self.types)[0]
            vector = torch.zeros(self.participants, dtype=torch.float64, device=self.device)
            vector[self.participant] = mine
            gathered = self.quorum.sum(vector).tolist()
            if all(w > 0 for w in gathered):  # else the reduction failed: no commit anyway
                weights = gathered
        return BatchPlan.derive(self.cfg.training, self.participants, weights)

    def _stop_due(self) -> bool:
        if not hasattr(self, "stop_checks"):
            from raytrain_lm.trainer.components.cadence import Every

            self.stop_checks = Every(seconds=self.cfg.fault.preemption_check_s)
        return self.stop_checks.due(
            self.state.step, self.end_step
        ) and stop_requests.stop_requested(self.run_dir)

    def _read_pending(self) -> dict[str, float]:
        metrics = super()._read_pending()
        per_device = metrics["perf/tokens_per_s"] / max(1, self.participants)
        metrics["perf/mfu"] = devices.mfu(self.flops_per_token, per_device, self.device)
        metrics["comm/bytes_sent"] = self.quorum.bytes.sent  # this group's, to the others
        trained = max(1, self.state.tokens - self.throughput.first_step * self.tokens_per_step)
        metrics["comm/bytes_per_token"] = self.quorum.bytes.sent / trained
        return metrics

    # ------------------------------------------------------------------------------ leaving

    def _share_flags(self) -> Flags:
        """Each group looks at its own node on its own clock; a stop was agreed in the step."""
        ask = self.every.signals.due(self.state.step, self.end_step)
        return Flags(ask=ask, stop=self.stop_seen)

    def _ends_group(self, flags: Flags) -> bool:
        """A stop ends every group at this step, after the chief's checkpoint. A spot notice
        ends this group alone: it leaves at this step boundary and the others go on; the last
        group checkpoints first, and the driver starts the run again elsewhere."""
        state = self.state
        if flags.stop:
            if self.is_chief:
                self.events.append(self._event(stop_requests.STOP, step=state.step))
            announce(f"stop: checkpoint at step {state.step}, then the run ends", self.is_chief)
            return True
        deadline_ms = self.ray.draining_deadline_ms(self.ray.node_id())
        if deadline_ms is None:
            return False
        self.leaving = True
        self.upload_deadline = deadline_ms / 1000 if deadline_ms else None
        self._event(
            "replica_drained", group=self.group, step=state.step, participants=self.participants
        )
        if self.participants > 1:
            announce(f"spot notice: replica group {self.group} leaves at step {state.step}")
            return True  # after this step's duties (_report_checkpoint)
        announce(f"spot notice for the last replica group: checkpoint at step {state.step}")
        self.events.append(
            self._event(stop_requests.PREEMPTION, step=state.step, deadline_ms=deadline_ms)
        )
        return True

    # ------------------------------------------------------------------------------ writing

    def _report_checkpoint(self, final: bool = False) -> None:
        """The chief alone writes the ledger and the checkpoint (every group holds the same
        state), and uploads it itself: replica groups report nothing to Ray Train, whose
        report waits for every worker."""
        if self.leaving and self.participants > 1:
            # A drained group that leaves the others training does what this step asks of
            # any group (the others have done their part of it: as chief, the periodic
            # checkpoint and ledger if one falls here) and no more.
            if not self.every.checkpoint.last_due:  # this step's periodic checkpoint
                return
            final = False
        if not self.is_chief:
            self.tracker.flush()  # the ledger's positions wait for the chief's word (_confirm)
            return
        if self.ledger:
            # A chief that died after writing a ledger file and before the others heard of it
            # left a file that this one's positions, since the last confirmed step, include.
            ledger.discard_after(self.run_dir, self.last_report_step)
        super()._report_checkpoint(final)

    def _publish_checkpoint(self, report: dict[str, float], local: Path | None, wait: bool) -> None:
        if local is not None:
            self.uploads.publish(local, f"checkpoint_{self.state.step:09d}", report, wait)

    def _heartbeat(self) -> None:
        if self.is_chief:
            if self.heartbeats is None:
                from raytrain_lm.run_events.journal import HeartbeatWriter

                self.heartbeats = HeartbeatWriter(self.run_dir)
            self.heartbeats.put(self._beat())
