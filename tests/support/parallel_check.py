"""The parallel strategies side by side, outside Ray: what tests/test_parallel.py measures.

`python -m support.parallel_check OUT` (from tests/) runs as one of 2 gloo ranks (torchrun's
environment variables); `reference(arch)` is the single-process run. Each run is our own
`train_step` on the same global batch of 8 sequences (micro-batches of 2, so the 2-rank runs
accumulate 2 each), 20 steps in fp32, from the same initial weights. The uneven runs split each
global batch 6 + 2 between the ranks (`scaling.balance`'s shares): under FSDP, where every rank
makes as many passes, rank 1's 2 sequences go through 3 passes, the last of them a weight-0
pass that only keeps the collectives in step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from raytrain_lm import devices
from raytrain_lm.checkpoints import TrainState
from raytrain_lm.checkpoints.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from raytrain_lm.config import TrainingConfig
from raytrain_lm.llama import Llama, LlamaShape
from raytrain_lm.model import GPT, GPTShape
from raytrain_lm.trainer.components.batch_plan import BatchPlan, learning_rate
from raytrain_lm.trainer.components.step import StepParts, accumulate_gradients, train_step
from raytrain_lm.trainer.distributed.mesh import build_meshes, plan_layout
from raytrain_lm.trainer.distributed.parallel import local_state_bytes, shard_model

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS, SAVE_AT = 64, 16, 8, 2, 20, 10
UNEVEN = [3.0, 1.0]  # weights: shares of 6 and 2
ARCHS = {
    "gpt2": lambda: GPT(GPTShape(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2,
                                 n_embd=32, dropout=0.0)),
    "llama": lambda: Llama(LlamaShape(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4,
                                      n_kv_head=2, n_embd=32, ffn_hidden=64,
                                      tie_embeddings=False)),
}  # fmt: skip
CPU = torch.device("cpu")


def _share(step: int, plan: BatchPlan, rank: int):
    """This rank's share of the step's global batch, as the data stream yields it."""
    # Counting up from a random start: learnable, so the losses fall.
    starts = np.random.default_rng(step).integers(0, VOCAB, (GLOBAL_BATCH, 1))
    tokens = (starts + np.arange(SEQ + 1)) % VOCAB
    first = plan.offset(rank)
    positions = np.arange(first, first + plan.shares[rank])
    yield positions, tokens[positions]


class Run:
    """A model, its optimizer and its steps under one strategy. `nodes`: each rank's node (a
    layout as Ray might hand it out; default one node), `shard_size` and `tensor` as in
    `parallel.*`."""

    def __init__(
        self,
        arch,
        strategy,
        rank=0,
        world=1,
        weights=None,
        nodes=None,
        shard_size=None,
        tensor=1,
        micro=MICRO,
    ):
        torch.manual_seed(0)
        self.rank, self.world = rank, world
        self.raw = ARCHS[arch]()
        model = self.raw
        self.layout = plan_layout(
            "ddp" if strategy == "single" else strategy,
            nodes or ["node"] * world,
            shard_size,
            tensor,
        )
        if strategy in ("fsdp", "hsdp"):
            data_mesh, tensor_mesh = build_meshes(self.layout, "cpu")
            if tensor_mesh is not None:
                from raytrain_lm.trainer.distributed.tensor_parallel import apply_tensor_parallel

                apply_tensor_parallel(self.raw, tensor_mesh)
            shard_model(self.raw, data_mesh, bf16=False)
            self.data_mesh = data_mesh
        elif strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(self.raw)
        self.optimizer = devices.build_adamw(self.raw.optimizer_groups(0.1), 1e-2, (0.9, 0.95), CPU)
        training = TrainingConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
        sharded = strategy in ("fsdp", "hsdp")
        world = self.layout.data_world
        plan = BatchPlan.derive(training, world, weights, same_passes=sharded)
        data_rank = self.layout.data_rank(rank)
        self.parts = StepParts(model, self.raw, self.optimizer, plan, data_rank, CPU, False, 1.0)

    def steps(self, first: int, last: int) -> list[float]:
        losses = []
        for step in range(first, last):
            lr = learning_rate(step, 1e-2, 1e-3, 3, STEPS)
            result = train_step(self.parts, _share(step, self.parts.plan, self.parts.rank), lr)
            loss = result.loss.detach().clone()  # this rank's part of the step's loss
            if self.world > 1:
                dist.all_reduce(loss)
            losses.append(loss.item() / self.layout.tensor)
        return losses

    def gradients(self, step: int) -> dict[str, torch.Tensor]:
        """The whole gradients (gathered from their shards) of the step's global batch, before
        clipping: what the reductions made of this rank's share."""
        (_, tokens), *_ = _share(step, self.parts.plan, self.parts.rank)
        accumulate_gradients(self.parts, tokens)
        grads = {}
        for name, p in self.raw.named_parameters():
            g = p.grad
            grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    def state_bytes(self) -> int:
        """Parameters + gradients + AdamW state held here, with the gradients of one backward
        still in place (as between backward and the optimizer step)."""
        (_, tokens), *_ = _share(0, self.parts.plan, self.parts.rank)
        t = torch.from_numpy(tokens[:MICRO])
        self.parts.model(t[:, :-1], t[:, 1:])[1].backward()
        held = local_state_bytes(self.raw, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return held


def reference(arch: str) -> list[float]:
    return Run(arch, "single").steps(0, STEPS)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for arch in ARCHS:
        ddp = Run(arch, "ddp", rank, world)
        ddp_losses = ddp.steps(0, STEPS)
        ddp_uneven = Run(arch, "ddp", rank, world, UNEVEN).steps(0, STEPS)
        fsdp_uneven = Run(arch, "fsdp", rank, world, UNEVEN).steps(0, STEPS)
        fsdp = Run(arch, "fsdp", rank, world)
        fsdp_losses = fsdp.steps(0, SAVE_AT)
        folder = Path(tempfile.mkdtemp(prefix=f"sharded-{arch}-{rank}-"))
        save_sharded_checkpoint(
            folder, fsdp.raw, fsdp.optimizer, TrainState(step=SAVE_AT, strategy="fsdp"), {},
            rank, full_weights=True,
        )  # fmt: skip
        fsdp_losses += fsdp.steps(SAVE_AT, STEPS)
        resumed = Run(arch, "fsdp", rank, world)
        # The one rank's folder that has DCP's metadata, with every rank's shards beside it:
        # what the upload makes of the ranks' folders.
        shared = out / f"checkpoint-{arch}"
        shared.mkdir(exist_ok=True)
        for f in folder.iterdir():
            f.rename(shared / f.name)
        dist.barrier()
        state = load_sharded_checkpoint(shared, resumed.raw, resumed.optimizer)
        results[arch] = {
            "ddp": ddp_losses,
            "fsdp": fsdp_losses,
            "ddp_uneven": ddp_uneven,
            "fsdp_uneven": fsdp_uneven,
            "resumed": resumed.steps(state.step, STEPS),
            "bytes_ddp": ddp.state_bytes(),
            "bytes_fsdp": fsdp.state_bytes(),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
