"""How a model is spread over the workers, applied from outside the model (as torchtitan does).

`ddp`: every worker holds the whole model, its gradients and its AdamW state; gradients are
all-reduced once per step. `fsdp` (FSDP2, `fully_shard`): each worker holds 1/N of each of
them; a block's parameters are all-gathered just before its forward and again for its backward,
and its gradients are reduce-scattered. `hsdp`: the same inside shard groups (a node's workers,
mesh.py), with the groups' shards all-reduced across nodes once per step: the per-block traffic
stays on the node's own links. FSDP trades communication for memory, so `auto` picks ddp when
its state fits a device, else hsdp when a shard group's does, else fsdp (`choose_strategy`).
Tensor parallelism (tensor_parallel.py) splits each block over a node's workers beneath either.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

from raytrain_lm.causal_lm import CausalLM
from raytrain_lm.config import ParallelConfig
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.distributed.mesh import Layout, build_meshes, plan_layout

# Persistent bytes per parameter while training with AdamW in fp32 master weights: the weight
# (4), its gradient (4) and the two moments (8). Mixed precision adds only transient bf16 copies.
STATE_BYTES_PER_PARAM = 16
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Parameters + gradients + optimizer state per device, against what a device has."""

    params: int
    world: int
    device_bytes: int  # the smallest device of the group
    fraction: float  # of a device the state may take; the rest is activations and buffers
    group: int = 0  # workers of an hsdp shard group (with tensor parallelism); 0: world

    def divisor(self, strategy: str) -> int:
        """Into how many parts each worker's copy of the state is cut under `strategy`."""
        return {"ddp": 1, "fsdp": self.world, "hsdp": self.group or self.world}[strategy]

    def per_device(self, strategy: str) -> float:
        return STATE_BYTES_PER_PARAM * self.params / self.divisor(strategy)

    @property
    def budget(self) -> float:
        return self.fraction * self.device_bytes

    def fits(self, strategy: str) -> bool:
        return self.per_device(strategy) <= self.budget

    def describe(self) -> str:
        hsdp = ""
        if self.group and self.group < self.world:
            hsdp = f", {self.per_device('hsdp') / GIB:.2f} GiB under hsdp in groups of {self.group}"
        return (
            f"{self.params / 1e6:,.1f}M parameters x {STATE_BYTES_PER_PARAM} B (weights, "
            f"gradients, AdamW) = {self.per_device('ddp') / GIB:.2f} GiB per device under ddp"
            f"{hsdp}, {self.per_device('fsdp') / GIB:.2f} GiB under fsdp at {self.world} "
            f"workers; budget {self.fraction:.0%} of {self.device_bytes / GIB:.1f} GiB = "
            f"{self.budget / GIB:.1f} GiB"
        )


def choose_strategy(setting: str, estimate: MemoryEstimate, previous: str | None) -> str:
    """The strategy to train with: `setting` unless it is `auto`, in which case the first of
    ddp, hsdp (when its shard groups are smaller than the world: more than one node) and fsdp
    whose state fits. A run keeps its checkpoints' format (`previous`): ddp stays ddp; a
    sharded run picks hsdp or fsdp afresh for the nodes it now has (both read its shards)."""
    if setting != "auto":
        return setting
    if previous == "ddp" or (previous is None and estimate.fits("ddp")):
        return "ddp"
    if estimate.group and estimate.group < estimate.world and estimate.fits("hsdp"):
        return "hsdp"
    return "fsdp"


def check_fits(strategy: str, estimate: MemoryEstimate) -> None:
    """Refuses a group whose state cannot fit even when sharded: it would fail at the first
    step, or thrash, after minutes of start-up."""
    if estimate.per_device(strategy) > estimate.device_bytes:
        raise UserError(
            f"the model does not fit under parallel.strategy={strategy}: {estimate.describe()}; "
            "use more workers, parallel.strategy=fsdp, or a smaller model"
        )


def choose_layout(
    parallel: ParallelConfig,
    node_ids: list[str],
    params: int,
    device_bytes: int,
    previous: str | None,
) -> tuple[Layout, MemoryEstimate]:
    """The strategy (`choose_strategy`) and its mesh over ranks on `node_ids`, refused when
    its state cannot fit the smallest device (`device_bytes`); and the estimate it used."""

    def layout(strategy: str) -> Layout:
        return plan_layout(strategy, node_ids, parallel.shard_size, parallel.tensor_parallel)

    setting = parallel.strategy
    estimate = MemoryEstimate(
        params=params,
        world=len(node_ids),
        device_bytes=device_bytes,
        fraction=parallel.auto_state_fraction,
        group=layout("hsdp").state_divisor if setting in ("hsdp", "auto") else 0,
    )
    strategy = choose_strategy(setting, estimate, previous)
    check_fits(strategy, estimate)
    return layout(strategy), estimate


def device_memory_bytes(device: torch.device, local_world_size: int) -> int:
    """Memory of this worker's device; on CPU, the host's memory shared by its local workers."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, local_world_size)


def shard_model(
    model: CausalLM,
    mesh,
    bf16: bool,
    reshard_after_forward: bool = True,
    compile_blocks: bool = False,
) -> None:
    """FSDP2 in place over `mesh` (mesh.build_meshes: 1-D for fsdp, 2-D replicate x shard for
    hsdp): each block is a unit of gathering, then the root (embeddings, final norm, output
    projection). Parameters become DTensors sharded on dim 0 (and replicated across hsdp's
    groups); tensor-parallel ones gain the data-parallel dimensions.

    With `bf16`, parameters are gathered in bf16 and gradients reduced in fp32 (the sharded
    master weights stay fp32). The last block keeps its parameters gathered after forward:
    its backward comes next, so freeing them would only gather them again at once. On CPU the
    gradients are summed and divided afterwards: gloo's AVG reduction under `fully_shard` has
    given silently wrong gradients (pytorch#162338).
    """
    # Imported here: FSDP and DTensor cost every worker process 0.7 s of CPU to import, and a
    # DDP run never needs them.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = MixedPrecisionPolicy()
    if bf16:
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.blocks) - 1
    units = []
    for i, block in enumerate(model.blocks):
        if compile_blocks:
            block.compile()  # in place: state dict names stay as they are
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=precision,
            reshard_after_forward=reshard_after_forward and i < last,
        )
        units.append(block)
    fully_shard(model, mesh=mesh, mp_policy=precision, reshard_after_forward=reshard_after_forward)
    if mesh.device_type == "cpu":
        for unit in [*units, model]:
            unit.set_force_sum_reduction_for_comms(True)


def apply_layout(
    model: CausalLM,
    layout: Layout,
    device: torch.device,
    bf16: bool,
    reshard_after_forward: bool,
    compile_blocks: bool,
    recompute: str,
) -> None:
    """Tensor parallelism, then activation checkpointing, then FSDP2, in place (torchtitan's
    order: tensor parallelism must find each block's own modules, not a checkpoint wrapper).
    Under ddp only the checkpointing; DDP wraps the model later, for the step."""
    from raytrain_lm.trainer.distributed.recompute import apply_activation_checkpointing

    data_mesh = tensor_mesh = None
    if layout.strategy != "ddp":
        data_mesh, tensor_mesh = build_meshes(layout, device.type)
    if tensor_mesh is not None:
        from raytrain_lm.trainer.distributed.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tensor_mesh)
    apply_activation_checkpointing(model, recompute)
    if data_mesh is not None:
        shard_model(model, data_mesh, bf16, reshard_after_forward, compile_blocks)


def replicate_model(model: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """DDP over `world` workers (the model itself on one). Buffers are not broadcast from rank
    0 before every step's first forward: the only ones are llama's RoPE tables, computed alike
    on every rank and never changed, and the broadcast would wait inside the forward that
    `scaling.balance` times."""
    if world <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    # torch 2.13 renamed the setting (the old name warns); 2.6-2.12 know only the old one.
    quiet = {"forward_sync_buffers": False}
    if "forward_sync_buffers" not in inspect.signature(DistributedDataParallel).parameters:
        quiet = {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **quiet)


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this worker holds of parameters, gradients and optimizer state (its shards)."""

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(local_bytes(p) for p in params)
    total += sum(local_bytes(p.grad) for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total
