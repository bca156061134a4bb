"""Loss over a fixed set of held-out sequences, identical whatever the world size: the
validation split during training, and any text for `raytrain-lm eval`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytrain_lm import devices
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.stream import validation_batches
from raytrain_lm.trainer.distributed.collectives import all_reduce


@dataclass(frozen=True)
class Totals:
    """Summed over every rank: each sequence's mean token loss, and the sequences."""

    loss_sum: float
    sequences: int

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.sequences, 1)


@dataclass(frozen=True)
class Evaluator:
    data_dir: str
    manifest: Manifest
    seq_len: int
    sequences: int | None  # None: the whole validation split
    batch: int
    rank: int
    world: int
    device: torch.device
    bf16: bool
    # A sharded model's forward is a collective (it gathers weights): every rank must run as
    # many as the rank with the most batches, the extra ones counting for nothing.
    same_count_on_every_rank: bool = False

    def __call__(self, model: torch.nn.Module) -> float:
        """Mean token loss; each rank takes a strided share, the sums are reduced."""
        return self.totals(model).mean_loss

    @torch.no_grad()
    def totals(self, model: torch.nn.Module) -> Totals:
        model.eval()
        share = validation_batches(
            self.data_dir,
            self.manifest,
            self.seq_len,
            self.sequences,
            self.rank,
            self.world,
            self.batch,
        )
        passes = len(share)
        if self.same_count_on_every_rank:  # agreed before any forward, each a collective
            passes = int(all_reduce([float(passes)], self.device, "max")[0])
        # Summed on the device and read once at the end: no host sync per batch.
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for tokens in share:
            t = devices.tokens_to_device(tokens, self.device)
            total += self._loss(model, t).double() * t.shape[0]
            count += t.shape[0]
        # Shaped as a full batch: a compiled model would recompile for another shape.
        filler = torch.zeros((self.batch, self.seq_len + 1), dtype=torch.int64, device=self.device)
        for _ in range(passes - len(share)):
            self._loss(model, filler)
        model.train()
        loss_sum, sequences = all_reduce([total.item(), float(count)], self.device)
        return Totals(loss_sum, int(sequences))

    def _loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with devices.autocast(self.device, self.bf16):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        return loss
