"""What a replica group that joins heals from: torchft sends a live peer's state (its
checkpoint transport), and the joiner takes over where the peer is (model, optimizer, train
state, what is consumed since the last checkpoint, what the chief has not logged or stored)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_lm.checkpoints import TrainState
from raytrain_lm.trainer import chaos

if TYPE_CHECKING:
    from raytrain_lm.trainer.groups.replicas import ReplicaGroup


class Healing:
    def __init__(self, group: ReplicaGroup):
        self.group = group
        self.healed_at: float | None = None  # when this group healed from a peer
        self.peer_throughput: dict[str, Any] | None = None  # a healed group's, to adopt

    @property
    def healed(self) -> bool:
        return self.healed_at is not None

    def for_peer(self) -> dict[str, Any]:
        """What a joining group heals from (torchft sends it from this group)."""
        group, parts = self.group, self.group.parts
        progress, trainee, journal = parts.progress, parts.trainee, parts.journal
        if parts.cfg.training.ledger:  # the run is being verified: say what was sent
            journal.event("replica_sent", group=group.group, step=progress.step, **self.digest())
        return {
            "model": trainee.model.state_dict(),
            "optim": trainee.optimizer.state_dict(),
            "train": asdict(progress.state),
            "last_report_step": progress.last_report_step,
            "unlogged": progress.pending.snapshot(),  # the healed group may be the next chief
            "unstored": parts.tracker.handover(),  # logged, maybe not stored (chief.py)
            "members": group.members.handover(),
            "segment": journal.segment,  # one worker group's life, for goodput, whoever writes
            "throughput": vars(journal.throughput).copy(),  # the summary's, whoever is chief
            "checkpoint_every": [parts.every.checkpoint.steps, parts.every.checkpoint.since],
        }

    def from_peer(self, state: dict[str, Any]) -> None:
        group, parts = self.group, self.group.parts
        cut = chaos.find(parts.spec.fault, "kill-while-healing")  # a chaos test's
        if cut is not None and state["train"]["step"] >= (cut.step or 0):
            chaos.maybe_fire(cut, "kill-while-healing", cut.step, group.group, parts.run_dir)
        parts.trainee.model.load_state_dict(state["model"])
        parts.trainee.optimizer.load_state_dict(state["optim"])
        progress = parts.progress
        progress.state = TrainState(**state["train"])
        progress.last_report_step = state["last_report_step"]
        progress.ledger = committed_since(
            progress.last_report_step, progress.step, parts.cfg.training.global_batch_size
        )
        progress.pending.adopt(state["unlogged"], parts.device)
        parts.tracker.adopt(state["unstored"])
        group.members.adopt(state["members"])
        parts.journal.segment = state["segment"]
        self.peer_throughput = state["throughput"]
        group.stops.forget()  # budget.max_usd: the spend, kept by the chief meanwhile
        # checkpoint.every_steps=auto's interval in use (interval.py)
        parts.every.checkpoint.count_every(*state["checkpoint_every"])
        self.healed_at = time.time()

    def adopt_throughput(self) -> None:
        if self.peer_throughput is not None:
            vars(self.group.parts.journal.throughput).update(self.peer_throughput)
            self.peer_throughput = None

    def digest(self) -> dict[str, str]:
        """SHA-256 of the weights and of the optimizer's state, bit for bit."""
        trainee = self.group.parts.trainee
        optimizer_state = [v for s in trainee.optimizer.state.values() for v in s.values()]
        digests = {}
        for name, tensors in (
            ("params_sha", trainee.model.state_dict().values()),
            ("optim_sha", optimizer_state),
        ):
            digest = hashlib.sha256()
            for tensor in tensors:
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            digests[name] = digest.hexdigest()[:16]
        return digests


def committed_since(first: int, end: int, global_batch: int) -> list[np.ndarray]:
    """The ledger's positions of steps [first, end): what every group holds of them."""
    g = global_batch
    return [np.arange(first * g, end * g, dtype=np.int64)] if end > first else []
