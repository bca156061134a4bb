"""What the driver hands every worker of a run: one frozen, typed record (no loose dict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_lm.config import RunConfig
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.chaos import Fault, Faults


@dataclass(frozen=True)
class TrackingTarget:
    uri: str
    run_id: str


@dataclass(frozen=True)
class WorkerSpec:
    config: RunConfig  # resolved: every path absolute, the tracking URI explicit
    data_dir: str  # the prepared dataset: a local path or a URI
    run_dir: RunDir
    tracking: TrackingTarget | None  # rank 0 logs here; None: tracking disabled
    expect_checkpoint: bool  # the run checkpointed before: starting at step 0 would be wrong
    read_cpus: float  # CPUs each Ray Data read task of this worker's stream asks for
    checkpoint_strategy: str | None = None  # the strategy its checkpoints were saved with
    fault: Fault | Faults | None = None  # fault injection for chaos tests (trainer/chaos.py)
    # A sweep trial's queue to Tune (sweeps/trial.py), for the replica groups' chief: Ray
    # Train's reports, which the trial's callback forwards otherwise, wait for every worker.
    reports: Any = None
    # scaling.capacity=spot_first: where this group may go (trainer/components/spot_first.py), set by fit.py
    market: str = "spot"
