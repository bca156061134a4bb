"""Bytes sent between nodes per training step under ddp, fsdp and hsdp, counted at the
collectives, on 4 gloo CPU ranks that pretend to be 2 nodes of 2 workers (issue 31).

The ranks sit on nodes a, b, a, b: the way Ray numbers workers without regard to nodes
(ray#45799), so the node-by-node ordering of trainer/distributed/mesh.py decides where the hsdp groups
fall. Each strategy builds its model as the trainer does (`build_model`, `replicate_model` or
`shard_model` over `build_meshes(plan_layout(...))`, fp32) and takes steps with the trainer's
`train_step` (gradient clipping on, AdamW).

Counting: while the measured steps run, every call of torch.distributed's `all_reduce`,
`all_gather_single`, `all_gather_into_tensor`, `reduce_scatter_single` and
`reduce_scatter_tensor` (what FSDP2 calls in torch 2.13: _fsdp_collectives.py) and of the
functional collectives DTensor uses (`_functional_collectives`: the gradient norm's
reduction) is recorded as (op, the group's ranks, bytes of the whole buffer: the all-reduced
tensor, an all-gather's output, a reduce-scatter's input). DDP reduces its gradient buckets
in C++; a comm hook that is torch's default `allreduce_hook` sends them through
`dist.all_reduce`, where they are counted like the rest.

From the counts to bytes between nodes, a stated model (the measured part is the counts):
a collective over n ranks runs as a ring of n links, each carrying 2(n-1)/n of the buffer for
an all-reduce (reduce-scatter, then all-gather) and (n-1)/n for an all-gather or a
reduce-scatter. A link crosses between nodes when its two ends sit on different nodes.
  node-ordered ring: the ring visits the group's ranks node by node (what NCCL's topology-aware
    rings do), so a group spanning k > 1 nodes has k crossing links, one inside one node 0.
  rank-ordered ring: the ring follows the group's rank order (gloo's rings); on a, b, a, b
    the whole world's ring crosses at every link.
The script launches its own 4 ranks and prints a table; the figures go to a JSON file.

    .venv/bin/python benchmarks/hsdp_traffic.py [--micro-batches 1 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raytrain_lm import devices
from raytrain_lm.config import ModelConfig, TrainingConfig
from raytrain_lm.models import build_model, parameter_count
from raytrain_lm.runtime import free_port
from raytrain_lm.trainer.components.batch_plan import BatchPlan
from raytrain_lm.trainer.components.step import StepParts, train_step
from raytrain_lm.trainer.distributed.mesh import build_meshes, plan_layout
from raytrain_lm.trainer.distributed.parallel import replicate_model, shard_model

NODES = ["a", "b", "a", "b"]  # each rank's node, interleaved as Ray may hand them out
STRATEGIES = ("ddp", "fsdp", "hsdp")
CPU = torch.device("cpu")
# (module, function): (the argument that is the whole buffer, multiplied by the group's size)
COLLECTIVES = {
    (dist, "all_reduce"): ("tensor", False),
    (dist, "all_gather_single"): ("output_tensor", False),
    (dist, "all_gather_into_tensor"): ("output_tensor", False),
    (dist, "reduce_scatter_single"): ("input", False),
    (dist, "reduce_scatter_tensor"): ("input", False),
    (funcol, "all_reduce"): ("self", False),
    (funcol, "all_gather_tensor"): ("self", True),
    (funcol, "all_gather_single"): ("self", True),
    (funcol, "reduce_scatter_tensor"): ("self", False),
    (funcol, "reduce_scatter_single"): ("self", False),
}


class CollectiveCounter:
    """Counts (op, group ranks, bytes) of each collective called while `counting` is on."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, tuple[int, ...], int]] = Counter()
        self.counting = False
        self._inside = threading.local()  # one collective may call another: count the outer
        for (module, name), (buffer_arg, times_group) in COLLECTIVES.items():
            setattr(module, name, self._wrap(module, name, buffer_arg, times_group))

    def _wrap(self, module, name: str, buffer_arg: str, times_group: bool):
        original = getattr(module, name)
        signature = inspect.signature(original)
        prefix = "funcol." if module is funcol else ""

        def counted(*args, **kwargs):
            if self.counting and not getattr(self._inside, "depth", 0):
                bound = signature.bind(*args, **kwargs).arguments
                group = _process_group(bound.get("group"), functional=module is funcol)
                ranks = tuple(dist.get_process_group_ranks(group))
                buffer = bound[buffer_arg]
                size = buffer.numel() * buffer.element_size() * (len(ranks) if times_group else 1)
                self.calls[(prefix + name, ranks, size)] += 1
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return counted


def _process_group(group, functional: bool):
    if functional:  # a ProcessGroup, a (mesh, dim) pair, a group name...
        return dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))
    return group or dist.group.WORLD


def _model_config(args) -> ModelConfig:
    return ModelConfig(
        arch=args.arch,
        n_layer=args.layers,
        n_head=4,
        n_embd=args.width,
        block_size=args.seq,
        vocab_size=args.vocab,
    )


def _batches(step: int, plan: BatchPlan, rank: int, args):
    """This rank's share of the step's global batch (random tokens: only the traffic counts)."""
    tokens = np.random.default_rng(step).integers(0, args.vocab, (plan.global_batch, args.seq + 1))
    first = plan.offset(rank)
    positions = np.arange(first, first + plan.shares[rank])
    yield positions, tokens[positions]


def measure(strategy: str, micro_batches: int, counter: CollectiveCounter, args) -> list:
    """Steps `strategy` with `micro_batches` forward passes per rank per step; returns the
    collectives of the measured steps, per step: [op, group ranks, bytes, calls per step]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(_model_config(args), args.vocab)
    layout = plan_layout(strategy, NODES)
    wrapped = model
    if strategy == "ddp":
        wrapped = replicate_model(model, CPU, world)
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)  # buckets via Python
    else:
        data_mesh, _ = build_meshes(layout, "cpu")
        shard_model(model, data_mesh, bf16=False)
    optimizer = devices.build_adamw(model.optimizer_groups(0.1), 1e-3, (0.9, 0.95), CPU)
    training = TrainingConfig(global_batch_size=world * micro_batches, micro_batch_size=1)
    plan = BatchPlan.derive(training, world, same_passes=strategy != "ddp")
    parts = StepParts(wrapped, model, optimizer, plan, layout.data_rank(rank), CPU, False, 1.0)
    counter.calls.clear()
    for step in range(args.warmup + args.steps):
        # the first step builds FSDP's state lazily; DDP rebuilds its buckets after it
        counter.counting = step >= args.warmup
        train_step(parts, _batches(step, plan, rank, args), 1e-3)
    counter.counting = False
    return [
        [op, list(ranks), size, n / args.steps] for (op, ranks, size), n in counter.calls.items()
    ]


def worker(out: Path, args) -> None:
    dist.init_process_group("gloo")
    counter = CollectiveCounter()
    results = {
        str(m): {s: measure(s, m, counter, args) for s in STRATEGIES} for m in args.micro_batches
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def ring_traffic(op: str, ranks: list[int], size: int) -> dict[str, float]:
    """Bytes the ring model sends for one call: in all, and over the links between nodes."""
    n = len(ranks)
    per_link = (2 if "all_reduce" in op else 1) * (n - 1) / n * size
    nodes = [NODES[r] for r in ranks]
    node_ordered = len(set(nodes)) if len(set(nodes)) > 1 else 0
    rank_ordered = sum(nodes[i] != nodes[(i + 1) % n] for i in range(n)) if n > 1 else 0
    return {
        "sent": n * per_link,
        "between_nodes": node_ordered * per_link,
        "between_nodes_rank_ordered": rank_ordered * per_link,
    }


def summarize(per_rank: list[list]) -> dict:
    """One strategy's figures per step. Every rank of a group records the group's calls; each
    group's are taken once, from its lowest rank, after checking that its ranks agree."""
    recorded = [{(op, tuple(r), size): n for op, r, size, n in calls} for calls in per_rank]
    figures = Counter()
    ops = Counter()
    for rank, calls in enumerate(recorded):
        for (op, ranks, size), n in calls.items():
            assert all(recorded[r].get((op, ranks, size)) == n for r in ranks), (op, ranks)
            if rank == min(ranks):
                for key, value in ring_traffic(op, list(ranks), size).items():
                    figures[key] += n * value
                ops[f"{op} over {list(ranks)}"] += n
    rank0 = recorded[0]
    return {
        "calls_per_rank": sum(rank0.values()),
        "buffer_bytes_per_rank": sum(n * size for (_, _, size), n in rank0.items()),
        **{key: round(value) for key, value in figures.items()},
        "calls_by_group": dict(ops),
    }


def launch(args) -> dict:
    """Runs the 4 ranks (this script with --worker), then sums up what they counted."""
    out = Path(tempfile.mkdtemp(prefix="hsdp-traffic-"))
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(len(NODES)),
        "OMP_NUM_THREADS": "1",  # 4 ranks on a few cores
    }
    command = [sys.executable, __file__, "--worker", str(out), *sys.argv[1:]]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r)}) for r in range(len(NODES))]
    codes = [p.wait(timeout=args.timeout) for p in ranks]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")
    counts = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(NODES))]
    params = parameter_count(_model_config(args), args.vocab)
    settings = {}
    for micro in map(str, args.micro_batches):
        figures = {s: summarize([c[micro][s] for c in counts]) for s in STRATEGIES}
        ddp = figures["ddp"]
        for f in figures.values():
            f["between_nodes_over_ddp"] = round(f["between_nodes"] / ddp["between_nodes"], 3)
            f["rank_ordered_over_ddp"] = round(
                f["between_nodes_rank_ordered"] / ddp["between_nodes_rank_ordered"], 3
            )
        settings[micro] = figures
    return {
        "nodes": NODES,
        "model": {
            "arch": args.arch,
            "n_layer": args.layers,
            "n_embd": args.width,
            "vocab": args.vocab,
            "params": params,
            "param_bytes": 4 * params,
        },  # fp32
        "steps": args.steps,
        "torch": torch.__version__,
        "micro_batches": settings,
    }


def print_table(result: dict) -> None:
    mb = 1e6
    print(
        f"nodes {result['nodes']}, {result['model']['params'] / 1e6:.2f}M params "
        f"({result['model']['param_bytes'] / mb:.1f} MB fp32), per step:"
    )
    print(
        f"{'passes':>6} {'strategy':<8} {'calls':>6} {'buffers MB':>11} {'sent MB':>9} "
        f"{'between nodes MB':>17} {'/ ddp':>7} {'rank-ordered MB':>16} {'/ ddp':>7}"
    )
    for micro, figures in result["micro_batches"].items():
        for s, f in figures.items():
            print(
                f"{micro:>6} {s:<8} {f['calls_per_rank']:>6.0f} "
                f"{f['buffer_bytes_per_rank'] / mb:>11.2f} {f['sent'] / mb:>9.2f} "
                f"{f['between_nodes'] / mb:>17.2f} {f['between_nodes_over_ddp']:>7.3f} "
                f"{f['between_nodes_rank_ordered'] / mb:>16.2f} {f['rank_ordered_over_ddp']:>7.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    # forward passes per rank per step (gradient accumulation)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default="benchmarks/results/hsdp_traffic.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the folder a rank writes to
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args)
        return
    result = launch(args)
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
