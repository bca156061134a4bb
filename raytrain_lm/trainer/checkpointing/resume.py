"""A worker group's start from the run's newest checkpoint that verifies and loads, the same on
every rank (restore.py chooses it)."""

from __future__ import annotations

from pathlib import Path

from raytrain_lm.errors import UserError
from raytrain_lm.trainer.checkpointing.restore import restore_group
from raytrain_lm.trainer.components.parts import LoopParts


def restore_newest(parts: LoopParts, rank: int) -> None:
    cfg, run_dir, trainee = parts.cfg, parts.run_dir, parts.trainee
    candidates: list[str] = list(run_dir.checkpoint_folders())
    offered = parts.ray.offered_checkpoint()
    if offered is not None and not run_dir.remote and Path(offered.path).is_dir():
        candidates.append(offered.path)  # normally one of the run directory's own
    restored, state = restore_group(
        candidates, trainee.model, parts.optimizer_state,
        trainee.device, rank, trainee.strategy, cfg.checkpoint.restore_wait_s,
    )  # fmt: skip
    if restored is None and parts.spec.expect_checkpoint:
        raise UserError(
            f"run '{cfg.name}' has checkpoints in {run_dir} but none can be restored; "
            "refusing to start from step 0 (remove the run directory to start afresh)"
        )
    if state.position != state.step * trainee.plan.global_batch:
        raise RuntimeError(f"inconsistent checkpoint: position {state.position}, step {state.step}")
    parts.progress.restored(state)
    parts.journal.restart_throughput(state.step)
