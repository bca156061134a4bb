"""DiLoCo's outer update (Douillard et al., arXiv 2311.08105) through torchft's `DiLoCo`: the
pseudo-gradients (the weights at the unit's start minus each group's now) averaged over the
participants, and the outer Nesterov SGD step on the start weights (torchft's fragments:
prepare_sync, perform_sync). With `diloco.fragments` > 1, Streaming DiLoCo (arXiv 2501.18512):
the fragments also sync alone, in turn, inside a unit (diloco_parts.py)."""

from __future__ import annotations

from typing import Any

import torch

from raytrain_lm.config import DilocoConfig
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.components.trainee import Trainee
from raytrain_lm.trainer.groups import torchft_adapter
from raytrain_lm.trainer.groups.quorum import ByteCounter
from raytrain_lm.trainer.syncs.diloco_parts import (
    CountingManager,
    InnerAndOuter,
    UnitStart,
    model_fragments,
)


class DilocoUpdate:
    def __init__(self, settings: DilocoConfig, trainee: Trainee):
        model, device = trainee.model, trainee.device
        if settings.quantize and device.type != "cuda":
            raise UserError("diloco.quantize needs CUDA (torchft's fused fp8 kernels)")
        self.settings, self.model, self.inner, self.device = (
            settings, model, trainee.optimizer, device,
        )  # fmt: skip
        self.fragments = settings.fragments
        self.model_fragments = model_fragments(model, settings.fragments)
        # One outer SGD per fragment: a fragment's sync steps only its own parameters.
        self.outer_optimizers = [
            torch.optim.SGD(
                fragment.parameters(),
                lr=settings.outer_lr,
                momentum=settings.outer_momentum,
                nesterov=settings.outer_momentum > 0,
            )
            for fragment in self.model_fragments
        ]
        for outer in self.outer_optimizers:
            outer.register_step_pre_hook(self._scale_outer_gradients)
        self.outer_scale = 1.0
        self.weight_syncs = 0.0
        self.synced: list[Any] = []  # torchft's fragments, driven here (on_manager)
        self.unit_start: UnitStart | None = None
        self.manager: Any = None

    def on_manager(self, manager: Any, bytes_sent: ByteCounter) -> None:
        """torchft's DiLoCo, made before the first quorum: it registers each fragment's start
        weights and outer optimizer with the Manager, so that a group joining at a sync heals
        them too."""
        from torchft.local_sgd import DiLoCo

        self.manager = manager
        diloco = DiLoCo(
            CountingManager(manager, bytes_sent),
            self.model_fragments,
            self.inner,
            self.outer_optimizers,
            sync_every=self.settings.sync_every,
            backup_device=self.device,
            pin_memory=False,
            # One flat all-reduce per sync, not one per parameter tensor: over a slow link each
            # all-reduce pays the round trips (docs/benchmarks.md: 2.7 s against 0.7 s a sync
            # of 27 tensors at 50 ms); the bytes are the same.
            use_bucketization=True,
            should_quantize=self.settings.quantize,
        )
        torchft_adapter.check_diloco(diloco)
        self.synced = torchft_adapter.diloco_fragments(diloco)  # syncs happen where we say
        if self.fragments > 1:  # one fragment: its own saved weights are the unit's start
            self.unit_start = UnitStart(self.model, self.outer_optimizers, self.synced, manager)

    def checkpointed_optimizer(self, inner: torch.optim.Optimizer) -> InnerAndOuter:
        return InnerAndOuter(inner, self.outer_optimizers)

    def unit_committed(self) -> None:
        for fragment in self.synced:
            fragment.save_parameters()
        if self.unit_start is not None:
            self.unit_start.take()

    def contribute_nothing(self) -> None:
        """Each fragment's weights set to those of its last sync: zero pseudo-gradients."""
        for fragment in self.synced:
            fragment.restore_parameters()

    def sync_all(self, scale: float) -> bool:
        self.weight_syncs += 1
        for fragment in self.synced:  # all in flight before any is waited for
            fragment.prepare_sync()
        self.outer_scale = scale
        committed = all([fragment.perform_sync() for fragment in self.synced])
        if committed and self.unit_start is not None:
            self.unit_start.take()  # torchft saved each fragment's weights as it committed
        return committed

    def sync_fragments(self, ids: list[int]) -> bool:
        """Single fragments synced inside a unit (Streaming DiLoCo), on the quorum of the
        unit's start, which every group of the unit trains in: a group that joins waits for the
        unit's end, and a group lost makes the all-reduce fail. Whether each committed: if not,
        the unit is lost for this group (the sync at its end tells the others)."""
        self.outer_scale = 1.0
        for index in ids:
            self.synced[index].prepare_sync()
        self.weight_syncs += len(ids) / len(self.synced)
        return all([self.synced[index].perform_sync() for index in ids])

    def roll_back(self) -> None:
        if self.unit_start is None:
            self.synced[0].restore_parameters()
        else:
            self.unit_start.put_back()

    def forget_last_verdict(self) -> None:
        torchft_adapter.forget_failed_sync(self.manager)

    def _scale_outer_gradients(self, *_args) -> None:
        """The outer optimizer's step pre-hook: torchft's average over the quorum, made one
        over the groups that trained; and the configured outer settings, which a checkpoint's
        or a peer's optimizer state would otherwise bring back."""
        settings = self.settings
        groups = [group for outer in self.outer_optimizers for group in outer.param_groups]
        for group in groups:
            group["lr"], group["momentum"] = settings.outer_lr, settings.outer_momentum
            group["nesterov"] = settings.outer_momentum > 0
        if self.outer_scale != 1.0:
            for group in groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(self.outer_scale)
