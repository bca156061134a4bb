"""`RaySide`: everything a worker asks of Ray (its device, checkpoints reported to Ray Train,
spot notices, the cluster's nodes), so that the worker's loop itself is plain PyTorch and
files. With entry.py and eval_entry.py, the only modules calling Ray Train's per-worker API.
"""

from __future__ import annotations

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

    @staticmethod
    def offered_checkpoint():
        """The checkpoint Ray Train offers this group (normally one of the run's own)."""
        return ray.train.get_checkpoint()
