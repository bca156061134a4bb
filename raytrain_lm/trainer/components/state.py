"""Where the run is, and the one place it moves on: each committed step advances the train
state (step, tokens, data position), the ledger of positions consumed since the last
checkpoint, and the queue of its metrics not read yet (pending_values.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from raytrain_lm.checkpoints import TrainState
from raytrain_lm.trainer.components.pending_values import PendingSteps


@dataclass
class StepRecord:
    """One committed step, as a sync hands it to the loop."""

    lr: float
    loss: torch.Tensor  # this process's part of the step's mean loss (device, not read)
    grad_norm: torch.Tensor
    positions: np.ndarray | None  # what this process puts in the ledger (None: nothing)
    data_wait_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. how many groups took part


@dataclass
class Settled:
    """What a group says of a step once committed: the loss it records (this process's part,
    or the participants' sum), the positions it puts in the ledger, metrics of its own."""

    loss: torch.Tensor
    positions: np.ndarray | None
    metrics: dict[str, float] = field(default_factory=dict)


class RunProgress:
    def __init__(self, global_batch: int, tokens_per_step: int, pending: PendingSteps):
        self.global_batch, self.tokens_per_step = global_batch, tokens_per_step
        self.state = TrainState()
        self.pending = pending
        self.ledger: list[np.ndarray] = []  # positions consumed since the last checkpoint
        self.last_report_step = 0  # the step of the newest checkpoint this run wrote or read
        self.train_loss = float("nan")  # the newest step read's

    @property
    def step(self) -> int:
        return self.state.step

    def advance(self, record: StepRecord) -> None:
        state = self.state
        state.step += 1
        state.tokens += self.tokens_per_step
        state.position += self.global_batch
        if record.positions is not None:
            self.ledger.append(record.positions)
        host = {"train/lr": record.lr, "progress/tokens": state.tokens, **record.metrics}
        self.pending.add(state.step, record.loss, record.grad_norm, host, record.data_wait_s)

    def restored(self, state: TrainState) -> None:
        """The state a checkpoint gave: nothing consumed since."""
        self.state, self.ledger, self.last_report_step = state, [], state.step

    def checkpointed(self) -> None:
        self.ledger, self.last_report_step = [], self.state.step
