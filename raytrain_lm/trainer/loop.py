"""`train_loop_per_worker`: what Ray Train runs in each worker (Ray's own pattern: restore
first, then step, then report), and `RaySide`, everything a worker asks of Ray.

This module is the only one that calls Ray Train's per-worker API (`ray.train.get_context`,
`get_checkpoint`, `report`, `get_preemption_info`, `ray.train.torch.get_device`), beside
`eval_loop.py`, the worker function of `raytrain-lm eval` (context and device only). The loop
itself is worker.py, plain PyTorch and files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointUploadMode

from raytrain_lm.storage import filesystem
from raytrain_lm.trainer.collectives import pin_gloo_interface
from raytrain_lm.trainer.spec import WorkerSpec
from raytrain_lm.trainer.storage_checks import check_worker_sees


def train_loop_per_worker(spec: WorkerSpec) -> None:
    t_start = time.time()
    _quiet_ray_train_info_logs()
    context = ray.train.get_context()
    pin_gloo_interface(ray.util.get_node_ip_address())  # before any gloo group (the flags')
    check_worker_sees(str(spec.run_dir), spec.data_dir, spec.config.output_dir)
    if spec.config.parallel.sync == "diloco":
        from raytrain_lm.trainer.diloco import DilocoWorker as Worker
    elif spec.config.scaling.fault_tolerance == "replicas":
        from raytrain_lm.trainer.replicas import ReplicaWorker as Worker
    else:
        from raytrain_lm.trainer.worker import Worker
    side = RaySide(context.get_local_world_size())
    worker = Worker(spec, side, context.get_world_rank(), context.get_world_size(), t_start)
    worker.restore(ray.train.get_checkpoint())
    worker.start()
    worker.train()


class RaySide:
    """A worker's view of Ray Train and of the cluster."""

    def __init__(self, local_world_size: int):
        self.device = ray.train.torch.get_device()
        self.local_world_size = local_world_size  # workers on this node

    def node_accelerator_type(self, device: torch.device) -> str:
        """This worker's accelerator type: its node's Ray resource `accelerator_type:X`, else
        the CUDA device's name, else `cpu`."""
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node["NodeID"] == node_id:
                for name in node.get("Resources", {}):
                    if name.startswith("accelerator_type:"):
                        return name.split(":", 1)[1]
        if device.type == "cuda":  # a GPU node without Ray's type resource
            return torch.cuda.get_device_name(device)
        return "cpu"

    @staticmethod
    def node_market() -> str | None:
        """How this worker's node is billed: `spot` or `on_demand` (our cluster configs' node
        resources), else None."""
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node["NodeID"] == node_id:
                resources = node.get("Resources", {})
                return next((m for m in ("spot", "on_demand") if resources.get(m)), None)
        return None

    def accelerator_types(self, world: int, device: torch.device) -> list[str]:
        """Every rank's accelerator type, in rank order (a collective)."""
        mine = self.node_accelerator_type(device)
        if world == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        types: list[str | None] = [None] * world
        dist.all_gather_object(types, mine)
        return [str(t) for t in types]

    def node_ids(self, world: int) -> list[str]:
        """Every rank's node, in rank order (a collective)."""
        mine = self.node_id()
        if world == 1:
            return [mine]
        nodes: list[str | None] = [None] * world
        dist.all_gather_object(nodes, mine)
        return [str(n) for n in nodes]

    @staticmethod
    def alive_node_ids() -> set[str]:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    @staticmethod
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    @staticmethod
    def draining_deadline_ms(node_id: str) -> int | None:
        """When this node is being drained (a spot notice), its deadline (ms since the epoch;
        0: none given), else None. One request to Ray's control plane, no collective."""
        from ray._private.state import state

        return state.get_draining_nodes().get(node_id)

    @staticmethod
    def preemption_info():
        """Ray Train's spot notice for this group, or None (a collective: every rank asks)."""
        return ray.train.get_preemption_info()

    @staticmethod
    def report(
        metrics: dict[str, Any],
        local: Path | None,
        wait: bool,
        upload: Callable[[Path, str], str],
    ) -> None:
        """Reports `metrics` and the checkpoint in `local` (this rank's part, or None) to Ray
        Train, which uploads it with `upload` (local folder, name -> where it went): in the
        background unless `wait`, and deletes the local folder afterwards."""

        def upload_fn(checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
            fs, inner = filesystem(upload(Path(checkpoint.path), name))
            return ray.train.Checkpoint(inner, filesystem=fs)

        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(local)) if local else None,
            checkpoint_upload_mode=CheckpointUploadMode.SYNC
            if wait
            else CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=upload_fn,
            delete_local_checkpoint_after_upload=True,
        )


def _quiet_ray_train_info_logs() -> None:
    # Ray Train logs every report and checkpoint at INFO from loggers named by file path,
    # which LoggingConfig does not reach; our progress line already says the same.
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)
