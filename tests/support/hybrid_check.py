"""Hybrid sharding and tensor parallelism on 4 gloo ranks, outside Ray: what
tests/test_hybrid.py measures.

`python -m support.hybrid_check OUT` (from tests/) runs as one of 4 ranks (torchrun's
environment variables). The ranks pretend to sit on two nodes the way Ray numbers workers
without regard to nodes (ray#45799): ranks 0 and 2 on node a, 1 and 3 on node b. The hsdp mesh
must therefore put {0, 2} and {1, 3} in shard groups, and each replica pair across the nodes.
Every run is parallel_check's `Run`: the same global batch of 8 sequences, 20 fp32 steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_lm.checkpoints import TrainState
from raytrain_lm.checkpoints.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from support.parallel_check import ARCHS, SAVE_AT, STEPS, Run

NODES = ["node-a", "node-b", "node-a", "node-b"]


def _gradient_gap(run: Run, reference: dict[str, torch.Tensor]) -> float:
    """Largest difference between `run`'s whole gradients and the one-process reference's."""
    grads = run.gradients(step=0)
    assert grads.keys() == reference.keys()
    return max((grads[k] - reference[k]).abs().max().item() for k in grads)


def _block_gap(rank: int) -> float:
    """One llama block split over 2 tensor-parallel ranks (each pair of ranks a group) against
    the same block whole: forward output and input gradient."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from raytrain_lm.trainer.distributed.tensor_parallel import block_plan

    torch.manual_seed(0)
    whole = ARCHS["llama"]().layers[0]
    torch.manual_seed(0)
    split = ARCHS["llama"]().layers[0]
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    parallelize_module(split, mesh, block_plan())
    model = ARCHS["llama"]()
    cos, sin = model.rope_cos, model.rope_sin
    torch.manual_seed(1)
    x = torch.randn(2, cos.shape[0], model.shape.n_embd, requires_grad=True)
    expected = whole(x, cos, sin)
    expected.square().sum().backward()
    # this rank's half of the sequence, as the block before it would hand it on
    mine = mesh.get_local_rank()
    part = x.detach().tensor_split(2, dim=1)[mine].clone().requires_grad_(True)
    # between blocks the activations are plain tensors, each rank's part of the sequence
    out = split(part, cos, sin)
    out.square().sum().backward()  # this rank's part of the same sum
    return max(
        (out - expected.tensor_split(2, dim=1)[mine]).abs().max().item(),
        (part.grad - x.grad.tensor_split(2, dim=1)[mine]).abs().max().item(),
    )


def _checkpointed_tensor_parallel_run(out: Path, rank: int, world: int) -> dict:
    """Tensor parallel x fsdp, checkpointed at SAVE_AT; the checkpoint resumed under the same
    layout (bit for bit) and under hsdp 2x2 without tensor parallelism (DCP reshards)."""
    run = Run("llama", "fsdp", rank, world, nodes=NODES, tensor=2)
    losses = run.steps(0, SAVE_AT)
    folder = out / f"tp-rank{rank}"
    state = TrainState(step=SAVE_AT, position=SAVE_AT * 8, strategy="fsdp")
    save_sharded_checkpoint(folder, run.raw, run.optimizer, state, {}, rank, full_weights=True)
    losses += run.steps(SAVE_AT, STEPS)
    shared = out / "checkpoint-tp"  # every rank's files in one folder, as the upload makes it
    shared.mkdir(exist_ok=True)
    for f in folder.iterdir():
        f.rename(shared / f.name)
    dist.barrier()
    resumed = {}
    for name, again in (
        ("same", Run("llama", "fsdp", rank, world, nodes=NODES, tensor=2)),
        ("hsdp", Run("llama", "hsdp", rank, world, nodes=NODES)),
    ):
        step = load_sharded_checkpoint(shared, again.raw, again.optimizer).step
        resumed[name] = again.steps(step, STEPS)
    return {"tp_losses": losses, "tp_resumed": resumed}


def _interleaved_fsdp_checkpoint(out: Path, rank: int, world: int) -> dict:
    """fsdp over ranks that Ray numbered across nodes (a, b, a, b: the mesh's order is 0, 2,
    1, 3): its DCP shards must say which rows each rank holds, whatever the group's numbering;
    the whole weights rank 0 gathers are compared with those rebuilt from the shards."""
    run = Run("gpt2", "fsdp", rank, world, nodes=NODES)
    losses = run.steps(0, SAVE_AT)
    folder = out / f"fsdp-rank{rank}"
    state = TrainState(step=SAVE_AT, position=SAVE_AT * 8, strategy="fsdp")
    save_sharded_checkpoint(folder, run.raw, run.optimizer, state, {}, rank, full_weights=True)
    shared = out / "checkpoint-fsdp"
    shared.mkdir(exist_ok=True)
    for f in folder.iterdir():
        f.rename(shared / f.name)
    dist.barrier()
    again = Run("gpt2", "fsdp", rank, world)  # rank order: another cut of every tensor
    load_sharded_checkpoint(shared, again.raw, again.optimizer)
    return {"fsdp_layout": list(run.layout.order), "fsdp_losses": losses + run.steps(SAVE_AT, STEPS),
            "fsdp_resumed": again.steps(SAVE_AT, STEPS)}  # fmt: skip


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    for arch in ARCHS:
        reference_grads = Run(arch, "single").gradients(step=0)
        ddp = Run(arch, "ddp", rank, world)
        hsdp = Run(arch, "hsdp", rank, world, nodes=NODES)
        groups = {
            dim: dist.get_process_group_ranks(hsdp.data_mesh.get_group(dim))
            for dim in ("replicate", "shard")
        }
        results[arch] = {
            "layout": list(hsdp.layout.order),
            "groups": groups,
            "bytes_ddp": ddp.state_bytes(),
            "bytes_hsdp": hsdp.state_bytes(),
            "grad_gap_hsdp": _gradient_gap(
                Run(arch, "hsdp", rank, world, nodes=NODES), reference_grads
            ),
            "ddp": ddp.steps(0, STEPS),
            "hsdp": hsdp.steps(0, STEPS),
            # 2 passes per step: the all-reduce across the groups only after the second
            "hsdp_accumulating": Run(arch, "hsdp", rank, world, nodes=NODES, micro=1).steps(
                0, STEPS
            ),
        }
        if arch == "gpt2":
            results[arch].update(_interleaved_fsdp_checkpoint(out, rank, world))
        if arch == "llama":  # tensor parallelism: llama's plan
            results[arch]["block_gap"] = _block_gap(rank)
            for strategy in ("fsdp", "hsdp"):
                name = f"tp_{strategy}"
                run = Run(arch, strategy, rank, world, nodes=NODES, tensor=2)
                results[arch][f"{name}_layout"] = run.layout.describe()
                results[arch][f"grad_gap_{name}"] = _gradient_gap(
                    Run(arch, strategy, rank, world, nodes=NODES, tensor=2), reference_grads
                )
                results[arch][f"bytes_{name}"] = run.state_bytes()
                results[arch][name] = run.steps(0, STEPS)
            results[arch].update(_checkpointed_tensor_parallel_run(out, rank, world))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
