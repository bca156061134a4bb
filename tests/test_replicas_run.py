"""Replica groups (`scaling.fault_tolerance=replicas`) on the session's Ray, with no incident:
the same steps as the suite's 2-worker DDP run. The incidents (nodes killed, added, drained)
are test_replicas.py's, on a multi-node Ray of their own (`make test-replicas`)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.trainer.checkpoint import complete_checkpoints, read_state
from raytrain_lm.trainer.goodput import read_events


def _losses(tracking_uri: str, run_id: str) -> dict[int, float]:
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, "train/loss")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), "a step logged twice"
    return {m.step: m.value for m in history}


def test_two_groups_take_ddps_steps_and_resume_from_their_checkpoint(world_size_runs, tmp_path):
    """Two replica groups (one worker each, a quorum every step) stop at step 6 and resume
    from their checkpoint: every step's loss equals the 2-worker DDP run's within 1e-5 (fp32;
    the gradients are reduced by torchft, not DDP), the ledger holds every position once, each
    step is logged once by one writer, and the checkpoints are those of a DDP run."""
    common, reference = world_size_runs["common"], world_size_runs["reference"]
    steps = reference["steps"]
    overrides = [
        *common,
        f"output_dir={tmp_path / 'runs'}",
        "name=replicas",
        "scaling.fault_tolerance=replicas",
        "scaling.num_workers=2",
    ]
    stopped = raytrain_lm.train(
        load_config(None, [*overrides, "training.stop_after_step=6"]), sample=False
    )
    assert stopped["steps"] == 6, stopped
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    assert summary["steps"] == steps and not summary["stopped"]

    run_dir = tmp_path / "runs" / "replicas"
    assert read_ledger(run_dir).tolist() == list(range(steps * 12))
    starts = [e for e in read_events(run_dir) if e["event"] == "replica_start"]
    assert sorted((e["step"], e["group"]) for e in starts) == [(0, 0), (0, 1), (6, 0), (6, 1)]
    checkpointed = sorted(read_state(c).step for c in complete_checkpoints(run_dir))
    assert checkpointed[-1] == steps and all(s % 3 == 0 for s in checkpointed), checkpointed
    assert summary["goodput"]["steps_recomputed"] == 0  # stopped at a checkpoint

    uri = next(o.split("=", 1)[1] for o in common if o.startswith("tracking.uri="))
    ours, ddp = (
        _losses(uri, summary["mlflow_run_id"]),
        _losses(uri, reference["mlflow_run_id"]),
    )
    assert sorted(ours) == sorted(ddp) == list(range(1, steps + 1))
    gap = max(abs(ours[s] - ddp[s]) for s in ours)
    assert gap < 1e-5, gap
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-4)
