"""The worker's loop in this process, without Ray (tests/test_loop_in_process.py): a one-worker
static group whose questions to Ray are answered here (this process is the whole cluster), whose
data is read from the prepared shards here (the same sequences, in the same global order, that
Ray Data streams to a worker), and whose metrics are kept in memory."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytrain_lm.checkpoints import complete_checkpoints
from raytrain_lm.config import load_config
from raytrain_lm.data.prepare import prepare
from raytrain_lm.data.stream import ShardCache, WorkerSlice
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer.groups.feed import sequence_order
from raytrain_lm.trainer.groups.static import StaticGroup
from raytrain_lm.trainer.spec import WorkerSpec
from raytrain_lm.trainer.syncs import SYNCS
from raytrain_lm.trainer.worker import Worker


class HereRay:
    """What a group asks of Ray (trainer/ray_side.py), for one worker on this machine's CPU."""

    device = torch.device("cpu")
    local_world_size = 1

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def accelerator_types(self, world: int, device: torch.device) -> list[str]:
        return ["cpu"] * world

    def node_ids(self, world: int) -> list[str]:
        return ["here"] * world

    @staticmethod
    def node_market() -> None:
        return None

    @staticmethod
    def alive_node_ids() -> set[str]:
        return {"here"}

    @staticmethod
    def node_id() -> str:
        return "here"

    @staticmethod
    def draining_deadline_ms(node_id: str) -> None:
        return None

    @staticmethod
    def preemption_info() -> None:
        return None

    @staticmethod
    def offered_checkpoint() -> None:
        return None  # restore_newest finds the run's own checkpoints

    def report(self, metrics: dict[str, Any], local: Path | None, wait: bool, upload) -> None:
        """As Ray Train does with a report: the checkpoint uploaded (here, at once), its local
        folder deleted."""
        self.reports.append(metrics)
        if local is not None:
            try:
                upload(local, f"checkpoint_{metrics['step']:09d}")
            finally:
                shutil.rmtree(local, ignore_errors=True)


class KeptMetrics:
    """A tracker that keeps what the loop logs, by step."""

    stored_through = -1

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.checkpoint_models: list = []  # tracking/models.py's CheckpointModel, in order

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.steps.setdefault(step, {}).update(metrics)
        self.stored_through = max(self.stored_through, step)

    def log_missing(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        for step, metrics in steps:
            self.log_metrics(metrics, step)

    def log_checkpoint(self, model) -> None:
        self.checkpoint_models.append(model)

    def flush(self) -> None:
        pass


class HereGroup:
    """A static group of one worker (groups/static.py) with its data read in this process."""

    def __init__(self, spec: WorkerSpec, ray: HereRay, kept: KeptMetrics):
        object.__setattr__(self, "static", StaticGroup(spec, ray, rank=0, world=1))
        object.__setattr__(self, "kept", kept)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.static, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.static, name, value)

    def tracker(self) -> KeptMetrics:
        return self.kept

    def data_stream(self, step: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        parts = self.static.parts
        trainee, plan = parts.trainee, parts.trainee.plan
        part = WorkerSlice(trainee.data_rank, trainee.data_world, plan.global_batch, plan.shares)
        order = sequence_order(parts)
        cache = ShardCache(parts.spec.data_dir, trainee.manifest, "train", order.window)
        first = parts.progress.step if step is None else step
        for each in range(first, parts.end_step):
            positions = part.positions(each, 1)
            shards, starts = order.locate_many(positions)
            yield positions, cache.sequences(shards, starts, order.seq_len + 1)


def here_spec(overrides: list[str]) -> WorkerSpec:
    """A worker's spec for a run of these overrides, its data prepared (the session's, where
    the settings match) and its run directory made, as the driver hands it to its workers."""
    cfg = load_config(None, overrides)
    run_dir = RunDir.of(cfg.output_dir, cfg.name)
    run_dir.create()
    return WorkerSpec(
        config=cfg,
        data_dir=str(prepare(cfg.data).directory),
        run_dir=run_dir,
        tracking=None,
        expect_checkpoint=bool(complete_checkpoints(run_dir)),
        read_cpus=0.5,
    )


def train_here(spec: WorkerSpec) -> tuple[KeptMetrics, HereRay]:
    """One worker group's life, as train_loop_per_worker runs it (entry.py), in this process."""
    ray, kept = HereRay(), KeptMetrics()
    group = HereGroup(spec, ray, kept)
    Worker(spec, ray, group, SYNCS[spec.config.parallel.sync], time.time()).run()
    return kept, ray
