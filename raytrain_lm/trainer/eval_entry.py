"""The Ray Train worker function of `raytrain-lm eval`: each worker scores its strided share
of the held-out text with the checkpoint's weights; the sums are all-reduced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raytrain_lm import devices
from raytrain_lm.data.manifest import MANIFEST_FILE, Manifest
from raytrain_lm.rundir import CONFIG_FILE
from raytrain_lm.trainer.components.evaluation import Evaluator
from raytrain_lm.trainer.storage_checks import check_visible


@dataclass(frozen=True)
class EvalSpec:
    checkpoint: str
    data_dir: str
    batch: int
    precision: str


def eval_loop_per_worker(spec: EvalSpec) -> dict[str, float]:
    """Rank 0's return value is `Result.return_value`: the totals over every rank."""
    import ray.train
    import ray.train.torch

    from raytrain_lm.generate import load_model

    check_visible(
        [
            ("the checkpoint", spec.checkpoint, Path(spec.checkpoint, CONFIG_FILE)),
            ("data.cache_dir", spec.data_dir, Path(spec.data_dir, MANIFEST_FILE)),
        ]
    )
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    devices.configure_device(device)
    model, _ = load_model(spec.checkpoint, device=str(device))
    evaluator = Evaluator(
        data_dir=spec.data_dir,
        manifest=Manifest.load(spec.data_dir),
        seq_len=model.block_size,
        sequences=None,
        batch=spec.batch,
        rank=context.get_world_rank(),
        world=context.get_world_size(),
        device=device,
        bf16=devices.use_bf16(device, spec.precision),
    )
    totals = evaluator.totals(model)
    return {"loss_sum": totals.loss_sum, "sequences": totals.sequences}
