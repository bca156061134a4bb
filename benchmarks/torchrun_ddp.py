"""Plain PyTorch DDP under torchrun: the baseline our Ray Train loop is measured against.

Same GPT, same global batch, data held in memory as one token array (random-offset batches,
as nanoGPT). Rank 0 writes steady-state tokens/s to --out.

    torchrun --nproc_per_node 2 benchmarks/torchrun_ddp.py --data DIR --out result.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raytrain_lm.data.manifest import Manifest, read_shard
from raytrain_lm.model import GPT, GPTShape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    manifest = Manifest.load(args.data)
    tokens = np.concatenate([read_shard(args.data, s) for s in manifest.splits["train"].shards])
    data = torch.from_numpy(tokens.astype(np.int64))
    torch.manual_seed(1337)
    shape = GPTShape(manifest.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = DistributedDataParallel(GPT(shape))
    optimizer = torch.optim.AdamW(model.module.optimizer_groups(0.1), lr=1e-3, betas=(0.9, 0.99))
    per_rank = args.global_batch // world
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        ix = torch.randint(len(data) - args.block_size - 1, (per_rank,), generator=generator)
        batch = torch.stack([data[i : i + args.block_size + 1] for i in ix])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)  # the same per-step loss sync our loop does
        times.append(time.perf_counter() - t0)
    if rank == 0:
        steady = times[args.warmup_steps :]
        tps = args.global_batch * args.block_size * len(steady) / sum(steady)
        with open(args.out, "w") as f:
            json.dump({"tokens_per_s": tps, "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
