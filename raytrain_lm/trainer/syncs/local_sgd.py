"""`parallel.sync=local_sgd`: LocalSGD's outer update (Stich, arXiv 1805.09767) through
torchft's `LocalSGD`: at the end of each round the groups' weights are averaged over the
groups that trained them. It is DiLoCo with an outer SGD of learning rate 1 and no momentum
(the start weights minus the mean pseudo-gradient are the mean weights), without the outer
optimizer's state. It reads `diloco.sync_every` (H) and `diloco.join_timeout_s`."""

from __future__ import annotations

from typing import Any

import torch

from raytrain_lm.config import DilocoConfig
from raytrain_lm.trainer.components.trainee import Trainee
from raytrain_lm.trainer.groups import torchft_adapter
from raytrain_lm.trainer.groups.quorum import ByteCounter
from raytrain_lm.trainer.syncs.diloco_parts import CountingManager

ROUND_START_KEY = "raytrain_lm_round_start"  # the Manager's name for the round's start weights


class LocalSgdUpdate:
    fragments = 1

    def __init__(self, settings: DilocoConfig, trainee: Trainee):
        self.settings, self.model, self.inner = settings, trainee.model, trainee.optimizer
        self.weight_syncs = 0.0
        self.start: list[torch.Tensor] = []  # the weights at the round's start
        self.manager: Any = None
        self.local_sgd: Any = None

    def on_manager(self, manager: Any, bytes_sent: ByteCounter) -> None:
        """torchft's LocalSGD (its averaging; rounds.py forms the quorums and votes), and the
        round's start weights registered with the Manager, so a group that heals mid-round
        goes back with the others if the round does not commit."""
        from torchft.local_sgd import LocalSGD

        self.manager = manager
        counting = CountingManager(manager, bytes_sent)
        self.local_sgd = LocalSGD(counting, self.model, self.inner, self.settings.sync_every)
        torchft_adapter.check_local_sgd(self.local_sgd)
        manager.register_state_dict_fn(
            ROUND_START_KEY, self._load_start, lambda: {"weights": self.start}
        )

    def checkpointed_optimizer(self, inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return inner

    def unit_committed(self) -> None:
        with torch.no_grad():
            self.start = [p.detach().clone() for p in self.model.parameters()]

    def contribute_nothing(self) -> None:
        """Zeros: the average, scaled to the groups that trained, is theirs alone."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.zero_()

    def sync_all(self, scale: float) -> bool:
        self.weight_syncs += 1
        averaged = torchft_adapter.average_parameters(self.local_sgd)
        committed = self.manager.should_commit()
        if committed:
            with torch.no_grad():
                for param, mean in zip(self.model.parameters(), averaged, strict=True):
                    param.copy_(mean * scale)
            self.unit_committed()
        return committed

    def sync_fragments(self, ids: list[int]) -> bool:
        raise AssertionError("LocalSGD syncs the whole model at once")

    def roll_back(self) -> None:
        with torch.no_grad():
            for param, start in zip(self.model.parameters(), self.start, strict=True):
                param.copy_(start)

    def forget_last_verdict(self) -> None:
        pass  # no syncs inside a round

    def _load_start(self, start: dict[str, list[torch.Tensor]]) -> None:
        self.start = [tensor.clone() for tensor in start["weights"]]
