"""MFU of a plain training loop on one GPU: nanoGPT's recipe (bf16 autocast, torch.compile,
fused AdamW, flash attention through SDPA, TF32) around raytrain-lm's model, one batch
resident on the GPU: the baseline our own step is measured against (gpu_check.py, part a).

    PYTHONPATH=. python benchmarks/gpu_mfu.py            # GPT-2 124M, on a machine with a GPU
    PYTHONPATH=. python benchmarks/gpu_mfu.py --steps 5 --n-layer 2 --n-embd 128  # CPU smoke test
    # FSDP2 as the trainer applies it (per-block compile, bf16 gather, fp32 reduce), on a
    # llama preset; under torchrun, sharded over the GPUs of the machine:
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/gpu_mfu.py --strategy fsdp --preset 1b
    # hsdp (shard groups of 4, replicated across them), or tensor parallelism beneath fsdp:
    PYTHONPATH=. torchrun --nproc-per-node 8 benchmarks/gpu_mfu.py --strategy hsdp --shard-size 4 \
        --preset 1b
    PYTHONPATH=. torchrun --nproc-per-node 8 benchmarks/gpu_mfu.py --strategy fsdp \
        --tensor-parallel 2 --preset 1b

Needs torch and pydantic (the model config), nothing else: no Ray, no MLflow. Anchors: 45-55%
MFU for models of this size on A100/H100.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from raytrain_lm import devices
from raytrain_lm.config import ModelConfig
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.models import build_model
from raytrain_lm.trainer.distributed.mesh import Layout, build_meshes, plan_layout
from raytrain_lm.trainer.distributed.parallel import shard_model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def node_ids() -> list[str]:
    """Every rank's host, in rank order (a collective where there are several ranks): the nodes
    the rank layout keeps shard and tensor-parallel groups inside (trainer/distributed/mesh.py)."""
    mine = socket.gethostname()
    if dist.get_world_size() == 1:
        return [mine]
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, mine)
    return [str(n) for n in nodes]


def shard_over_mesh(
    model: torch.nn.Module,
    device: torch.device,
    strategy: str,
    bf16: bool,
    compile_blocks: bool,
    shard_size: int | None = None,
    tensor_parallel: int = 1,
) -> Layout:
    """`model` sharded in place as the trainer's worker does it (trainer/worker.py): the rank
    layout over the nodes (fsdp: 1-D; hsdp: replicate x shard), its meshes, tensor parallelism
    first where asked (llama), then FSDP2 over the data-parallel mesh. Every rank calls it at
    the same point (it builds process groups). Returns the layout: who reads which data."""
    layout = plan_layout(strategy, node_ids(), shard_size, tensor_parallel)
    data_mesh, tensor_mesh = build_meshes(layout, device.type)
    if tensor_mesh is not None:
        from raytrain_lm.trainer.distributed.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tensor_mesh)
    shard_model(model, data_mesh, bf16, compile_blocks=compile_blocks)
    return layout


def plain_loop(
    model: torch.nn.Module,
    raw: torch.nn.Module,
    device: torch.device,
    bf16: bool,
    micro_batch: int,
    accumulation: int,
    steps: int,
    warmup: int,
) -> dict:
    """`warmup` then `steps` timed optimizer steps of `model` (as wrapped: compiled, sharded)
    on one random batch kept on the device, each step waited for; tokens/s over the timed ones."""
    shape = raw.shape
    optimizer = devices.build_adamw(raw.optimizer_groups(0.1), 6e-4, (0.9, 0.95), device)
    data = torch.randint(0, shape.vocab_size, (micro_batch, shape.block_size + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    times = []
    for step in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(accumulation):
            with devices.autocast(device, bf16):
                _, loss = model(x, y)
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)  # DTensor-aware under fsdp
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    tokens_per_s = micro_batch * accumulation * shape.block_size * len(times) / sum(times)
    return {"tokens_per_s": round(tokens_per_s), "loss": round(loss.detach().item(), 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)  # GPT-2's 50257, padded to 64
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--preset", choices=("tiny", "125m", "1b", "7b"), help="a llama preset instead")
    p.add_argument("--strategy", choices=("single", "fsdp", "hsdp"), default="single")
    p.add_argument("--shard-size", type=int, help="hsdp: ranks per shard group (unset: a node's)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="fsdp, hsdp: llama only")
    args = p.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    devices.configure_device(device)
    bf16 = devices.use_bf16(device, "auto")
    compile_model = not args.no_compile and device.type == "cuda"
    torch.manual_seed(0)
    if args.preset:
        raw = build_model(ModelConfig(preset=args.preset, vocab_size=args.vocab_size), 0)
    else:
        shape = GPTShape(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
        raw = GPT(shape)
    raw = raw.to(device)
    model, tensor, mesh = raw, 1, None
    if args.strategy != "single":
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        layout = shard_over_mesh(
            raw, device, args.strategy, bf16, compile_model, args.shard_size, args.tensor_parallel
        )
        tensor, mesh = layout.tensor, layout.describe()
    elif compile_model:
        model = torch.compile(raw)
    figures = plain_loop(
        model, raw, device, bf16, args.micro_batch, args.accumulation, args.steps, args.warmup
    )
    # tokens/s is this rank's; a tensor-parallel group's ranks share the same tokens' work
    flops = raw.flops_per_token() * figures["tokens_per_s"] / tensor
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.preset or "gpt2",
        "strategy": args.strategy,
        "world_size": world,
        "mesh": mesh,
        "params_M": round(raw.num_params(non_embedding=False) / 1e6, 1),
        "bf16": bf16,
        "compiled": compile_model,
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated(device) / (1 << 30), 2)
        if cuda
        else None,
        "flash_sdpa": device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled(),
        **figures,
        "achieved_tflops": round(flops / 1e12, 2),
        "peak_tflops": devices.peak_flops(device) / 1e12,
        "mfu": round(flops / devices.peak_flops(device), 4),
    }
    if rank == 0:
        print("gpu_mfu: " + json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
