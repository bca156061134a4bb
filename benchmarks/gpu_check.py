"""The GPU check: raytrain-lm's training step on the lent GPU machine as it is (Python 3.12, a
CUDA torch, no Ray, no MLflow, no network), against plain PyTorch, in at most 6 minutes. It
drives our own parts without Ray: the model, the step (trainer/components/step.py: micro-batches, token
weighting, clipping, fused AdamW), token batches crossing from host memory in their compact
dtype (devices.tokens_to_device), losses queued on the device and read at log steps
(trainer/components/pending_values.py), FSDP2 sharding (trainer/distributed/parallel.py) and
DCP checkpoints written, uploaded and restored as a run does (raytrain_lm/checkpoints/,
trainer/checkpointing/restore.py).

(a) GPT-2 124M, bf16, compiled: tokens/s and MFU of our step and of the plain loop
    (gpu_mfu.py: nanoGPT's recipe, one batch resident on the GPU), side by side, and the ratio;
(b) a Llama of about 350M parameters under FSDP2 on the one GPU: tokens/s and MFU;
(c) a Llama of about 125M under FSDP2 with selective activation checkpointing: a DCP
    checkpoint at step 25, a fresh model and optimizer restored from it, steps 26-50 again;
    the resumed losses against the uninterrupted ones, and the host's waits for the device at
    the steady steps that read nothing, counted by our counter (reads from our code) and by
    torch.cuda.set_sync_debug_mode (every synchronization torch makes);
(d) the Llama of (b) under hsdp: a 2-D mesh, replicas x shard groups of half the ranks
    (1 x 1 on one GPU: NCCL, the bf16 gather and the per-block compile all the same);
(e) the Llama of (b) with tensor_parallel=2 beneath fsdp, where there are 2 GPUs or more;
    (d) and (e) take (b)'s batches from the same weights: their losses against (b)'s;
(f) peak GPU memory of each.

The JSON file is written after every part (a part that fails records its error and the next
one runs); one line per part is printed. One process per GPU: run plainly for one GPU, or
under `torchrun --nproc-per-node N` for N (gpu_check.sh --nproc-per-node N). `--dry-run`: the
same code on CPU at toy sizes, what `make test` runs. `--parts`: only those named. See
benchmarks/gpu_check.sh and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from gpu_mfu import plain_loop, shard_over_mesh
from gpu_wheels import DEVICE_MODULES, carried_modules

from raytrain_lm import devices
from raytrain_lm.checkpoints import TrainState, upload_checkpoint
from raytrain_lm.checkpoints.sharded import save_sharded_checkpoint
from raytrain_lm.config import ModelConfig, TrainingConfig
from raytrain_lm.models import build_model
from raytrain_lm.trainer.chaos import SyncCounter
from raytrain_lm.trainer.checkpointing.restore import restore_group
from raytrain_lm.trainer.components.batch_plan import BatchPlan, learning_rate
from raytrain_lm.trainer.components.pending_values import PendingSteps
from raytrain_lm.trainer.components.step import StepParts, step_seed, train_step
from raytrain_lm.trainer.distributed.collectives import FlagChannel
from raytrain_lm.trainer.distributed.mesh import Layout
from raytrain_lm.trainer.distributed.parallel import replicate_model
from raytrain_lm.trainer.distributed.recompute import apply_activation_checkpointing

BUDGET_S = 360.0
SEED = 1337
WARMUP_STEPS = 3  # a group's first steps compile and autotune: not steady, as in trainer/entry.py
SHAPES = {  # GPU sizes, then the dry run's
    "gpt2": {"arch": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
             "vocab_size": 50304},  # GPT-2's 50,257 padded to a multiple of 64
    "llama_350m": {"arch": "llama", "n_layer": 24, "n_head": 16, "n_kv_head": 8, "n_embd": 1024,
                   "block_size": 1024, "vocab_size": 32000},
    "llama_125m": {"preset": "125m", "vocab_size": 32000},
}  # fmt: skip
TOY_SHAPES = {
    "gpt2": {"arch": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64,
             "vocab_size": 512},
    "llama_350m": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
                   "block_size": 64, "vocab_size": 512},
    "llama_125m": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
                   "block_size": 64, "vocab_size": 512},
}  # fmt: skip


class Setup:
    """This process's rank and device, its process group, and the settings a run would take."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        cuda = torch.cuda.is_available() and not dry_run
        local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        devices.configure_device(self.device)
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:  # torchrun: its rendezvous
            dist.init_process_group(backend)
        else:  # one process, as `gpu_check.sh` runs it on one GPU
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.bf16 = devices.use_bf16(self.device, "auto")
        self.compile = devices.use_compile(self.device, "auto")
        self.fsdp_losses: dict[int, float] = {}  # part (b)'s, for (d) and (e) to compare

    @property
    def compiles_blocks(self) -> bool:
        """Whether (d) and (e) compile each block: where a run would (a GPU), and in a dry run
        of one process (CPU inductor; several compiling at once on a few cores take minutes)."""
        return self.compile or (self.dry_run and self.world == 1)

    def model_config(self, name: str) -> ModelConfig:
        return ModelConfig(**(TOY_SHAPES if self.dry_run else SHAPES)[name])

    def peak_memory_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)

    def fresh_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)


def synthetic_batches(
    vocab: int, seq_len: int, plan: BatchPlan, rank: int, first_step: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """This rank's share of each step from `first_step` on, as the data stream yields it:
    (global positions, token ids [share, seq_len + 1] in the shards' compact dtype). A step's
    tokens depend only on the step, so a restored run reads what the uninterrupted one did."""
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    offset, share = plan.offset(rank), plan.shares[rank]
    step = first_step
    while True:
        rng = np.random.default_rng([SEED, step])
        tokens = rng.integers(0, vocab, (plan.global_batch, seq_len + 1)).astype(dtype)
        start = step * plan.global_batch + offset
        yield np.arange(start, start + share), tokens[offset : offset + share]
        step += 1


class OurLoop:
    """Our training step as the worker loop drives it (trainer/worker.py and
    syncs/every_step.py): a seed and a learning rate per step, `train_step` on this rank's share,
    the loss and grad norm queued on the device, the stop flags shared, values read only at
    steps that log. Sharded (fsdp, hsdp) as the worker does it: its rank layout and meshes,
    a tensor-parallel group reading one share of the data together."""

    def __init__(
        self,
        setup: Setup,
        model_cfg: ModelConfig,
        global_batch: int,
        micro_batch: int,
        strategy: str,
        compile_model: bool,
        activation_checkpointing: str = "none",
        shard_size: int | None = None,
        tensor_parallel: int = 1,
    ):
        self.setup, self.strategy = setup, strategy
        device = setup.device
        torch.manual_seed(SEED)
        self.raw = build_model(model_cfg, model_cfg.vocab_size).to(device)
        apply_activation_checkpointing(self.raw, activation_checkpointing)
        self.layout = Layout("ddp", setup.world, 1, 1, tuple(range(setup.world)))
        if strategy != "ddp":
            self.layout = shard_over_mesh(
                self.raw, device, strategy, setup.bf16, compile_model, shard_size, tensor_parallel
            )
            model = self.raw
        else:
            model = replicate_model(self.raw, device, setup.world)
            if compile_model:
                model = torch.compile(model)
        self.optimizer = devices.build_adamw(
            self.raw.optimizer_groups(0.1), 6e-4, (0.9, 0.95), device
        )
        training = TrainingConfig(global_batch_size=global_batch, micro_batch_size=micro_batch)
        self.data_rank = self.layout.data_rank(setup.rank)
        self.plan = BatchPlan.derive(training, self.layout.data_world)
        self.parts = StepParts(
            model, self.raw, self.optimizer, self.plan, self.data_rank, device, setup.bf16, 1.0
        )
        self.pending = PendingSteps(setup.world, loss_copies=self.layout.tensor)
        self.flags = FlagChannel(device, 300.0)
        self.step = 0
        self.losses: dict[int, float] = {}
        self.counter: SyncCounter | None = None
        self.tokens_per_step = global_batch * model_cfg.block_size

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        shape = self.raw.shape
        return synthetic_batches(
            shape.vocab_size, shape.block_size, self.plan, self.data_rank, self.step
        )

    def run(self, batches, to_step: int, read_every: int) -> None:
        while self.step < to_step:
            torch.manual_seed(step_seed(SEED, self.step, self.data_rank))
            lr = learning_rate(self.step, 6e-4, 6e-5, 10, 50)
            result = train_step(self.parts, batches, lr)
            self.step += 1
            self.pending.add(self.step, result.loss, result.grad_norm, {}, result.data_wait_s)
            self.flags.share([0, 0])
            if self.counter is not None:
                self.counter.close_step(self.step)
            if self.step % read_every == 0 or self.step == to_step:
                for step, metrics in self.pending.read().steps:
                    self.losses[step] = metrics["train/loss"]
                if self.counter is not None:
                    self.counter.close_read(self.step)

    def timed(self, warmup: int, steps: int, read_every: int) -> float:
        """Tokens/s over `steps` steps after `warmup` (each end waited for by a read)."""
        batches = self.batches()
        self.run(batches, warmup, read_every)
        started = time.perf_counter()
        self.run(batches, warmup + steps, read_every)
        return steps * self.tokens_per_step / (time.perf_counter() - started)

    def figures(self, tokens_per_s: float) -> dict:
        mfu = devices.mfu(
            self.raw.flops_per_token(), tokens_per_s / self.setup.world, self.setup.device
        )
        return {"tokens_per_s": round(tokens_per_s), "mfu": round(mfu, 4)}


def part_a(setup: Setup) -> dict:
    """GPT-2 124M: our step against the plain loop, same shape, batch and compile."""
    cfg = setup.model_config("gpt2")
    micro, accumulation = (4, 2) if setup.dry_run else (16, 4)
    warmup, steps = (2, 6) if setup.dry_run else (10, 30)
    compile_model = setup.compile or setup.dry_run  # the dry run compiles too: CPU inductor
    setup.fresh_memory()
    torch.manual_seed(SEED)
    raw = build_model(cfg, cfg.vocab_size).to(setup.device)
    model = torch.compile(raw) if compile_model else raw
    plain = plain_loop(model, raw, setup.device, setup.bf16, micro, accumulation, steps, warmup)
    plain_mfu = devices.mfu(raw.flops_per_token(), plain["tokens_per_s"], setup.device)
    plain |= {"mfu": round(plain_mfu, 4), "peak_memory_GiB": setup.peak_memory_gib()}
    del raw, model
    setup.fresh_memory()
    global_batch = micro * accumulation * setup.world
    ours = OurLoop(setup, cfg, global_batch, micro, "ddp", compile_model)
    figures = ours.figures(ours.timed(warmup, steps, read_every=10))
    figures["peak_memory_GiB"] = setup.peak_memory_gib()
    return {
        "model": f"gpt2 {ours.raw.num_params(non_embedding=False) / 1e6:.1f}M",
        "plain_loop": {k: plain[k] for k in ("tokens_per_s", "mfu", "peak_memory_GiB")},
        "ours": figures,
        "ours_over_plain": round(figures["tokens_per_s"] / plain["tokens_per_s"], 3),
        "steps": steps,
        "bf16": setup.bf16,
        "compiled": compile_model,
    }


def _llama_sharded(
    setup: Setup, strategy: str, compile_model: bool, **mesh
) -> tuple[OurLoop, dict]:
    """A Llama of about 350M parameters under `strategy` over the mesh `mesh` describes
    (shard_size, tensor_parallel), (b)'s global batch from the same weights: tokens/s, MFU."""
    cfg = setup.model_config("llama_350m")
    setup.fresh_memory()
    micro = 2 if setup.dry_run else 8
    warmup, steps = (2, 4) if setup.dry_run else (8, 20)
    loop = OurLoop(setup, cfg, 4 * micro * setup.world, micro, strategy, compile_model, **mesh)
    figures = loop.figures(loop.timed(warmup, steps, read_every=10))
    return loop, {
        "mesh": loop.layout.describe(),
        "params_M": round(loop.raw.num_params(non_embedding=False) / 1e6, 1),
        **figures,
        "steps": steps,
        "peak_memory_GiB": setup.peak_memory_gib(),
        "compiled": compile_model,
    }


def _against_fsdp(setup: Setup, loop: OurLoop) -> dict:
    """`loop`'s losses against (b)'s, where (b) ran: the same sum over the same batches from
    the same weights, computed over another mesh (within float error: 1e-4 in fp32 on CPU;
    1e-1 in bf16 with other kernels, reductions and compiled graphs)."""
    losses = loop.losses
    ok = all(math.isfinite(v) for v in losses.values())
    gap = None
    if setup.fsdp_losses:
        gap = max(abs(losses[s] - fsdp) for s, fsdp in setup.fsdp_losses.items())
        ok = ok and gap <= (1e-4 if setup.device.type == "cpu" else 1e-1)
    return {"loss_at_end": round(losses[loop.step], 4), "loss_gap_to_fsdp": gap, "ok": ok}


def part_b(setup: Setup) -> dict:
    """A Llama of about 350M parameters under FSDP2 on the GPU(s)."""
    loop, result = _llama_sharded(setup, "fsdp", setup.compile)
    setup.fsdp_losses = dict(loop.losses)
    return result


def part_d(setup: Setup) -> dict:
    """(b)'s Llama under hsdp: a 2-D mesh, replicas x shard groups of half the ranks (on one
    GPU, 1 x 1: still NCCL, the bf16 gather and the per-block compile), compiled as a run
    on a GPU compiles it (`Setup.compiles_blocks`); its losses against (b)'s."""
    shard_size = setup.world // 2 if setup.world % 2 == 0 else None  # None: a node's ranks
    loop, result = _llama_sharded(setup, "hsdp", setup.compiles_blocks, shard_size=shard_size)
    return result | _against_fsdp(setup, loop)


def part_e(setup: Setup) -> dict:
    """(b)'s Llama with each block split over tensor-parallel pairs of GPUs (trainer/
    tensor_parallel.py), fsdp over the pairs, compiled as (d); its losses against (b)'s."""
    if setup.world < 2 or setup.world % 2:
        return {
            "skipped": f"tensor_parallel=2 needs an even number of GPUs, at least 2, one "
            f"process each; this check runs {setup.world} (gpu_check.sh --nproc-per-node N)"
        }
    loop, result = _llama_sharded(setup, "fsdp", setup.compiles_blocks, tensor_parallel=2)
    return result | _against_fsdp(setup, loop)


def part_c(setup: Setup, workdir: Path) -> dict:
    """Stop at step 25 with a DCP checkpoint, restore a fresh model and optimizer from it,
    take steps 26-50 again; the uninterrupted run goes on to 50 beside it."""
    cfg = setup.model_config("llama_125m")
    setup.fresh_memory()
    micro, half, end = (2 if setup.dry_run else 8), 25, 50
    build = (setup, cfg, 2 * micro * setup.world, micro, "fsdp", True, "selective")
    counter = SyncCounter(setup.device)
    first = OurLoop(*build)
    first.counter = counter
    batches = first.batches()
    first.run(batches, half, read_every=10)
    checkpoint = _save(first, workdir)
    counter.reset()  # saving waits for the device: not a step's
    first.run(batches, end, read_every=10)
    # Each run's own steps after its warm-up (its first steps compile): none may wait.
    steady = [
        (counter.per_step.pop(s), counter.device_per_step.pop(s, 0)) for s in range(1, end + 1)
    ]
    steady = steady[WARMUP_STEPS:]

    resumed = OurLoop(*build)
    location, state = restore_group(
        [checkpoint], resumed.raw, resumed.optimizer, setup.device, setup.rank, "fsdp", 600.0
    )
    counter.reset()
    resumed.step, resumed.counter = state.step, counter
    resumed.run(resumed.batches(), end, read_every=10)
    later = range(state.step + 1 + WARMUP_STEPS, end + 1)
    steady += [(counter.per_step[s], counter.device_per_step.get(s, 0)) for s in later]

    gap = max(abs(first.losses[s] - resumed.losses[s]) for s in range(half + 1, end + 1))
    ours = sum(mine for mine, _ in steady)
    theirs = sum(torch_s for _, torch_s in steady) if counter.counts_device else None
    tolerance = 1e-5 if setup.device.type == "cpu" else 5e-2  # bf16, nondeterministic kernels
    return {
        "params_M": round(first.raw.num_params(non_embedding=False) / 1e6, 1),
        "restored_from": Path(location).name if location else None,
        "restored_step": state.step,
        "resumed_loss_gap": gap,
        "loss_at_50": round(first.losses[end], 4),
        "host_syncs_at_steady_steps": {"ours": ours, "torch": theirs, "steps": len(steady)},
        "peak_memory_GiB": setup.peak_memory_gib(),
        "ok": state.step == half and gap <= tolerance and ours == 0 and not theirs,
    }


def _save(loop: OurLoop, workdir: Path) -> str:
    """A sharded checkpoint as a run writes one: each rank's shards in a local folder, then
    uploaded into the run directory, the COMPLETE marker last."""
    step = loop.step
    local = workdir / f"local-{loop.setup.rank}"
    state = TrainState(
        step=step,
        tokens=step * loop.tokens_per_step,
        position=step * loop.plan.global_batch,
        world_size=loop.setup.world,
        strategy="fsdp",
    )
    save_sharded_checkpoint(
        local, loop.raw, loop.optimizer, state, {}, loop.setup.rank, full_weights=False
    )
    destination = str(workdir / "run" / f"checkpoint_{step:06d}")
    chief = loop.setup.rank == 0
    upload_checkpoint(local, destination, 300.0, gather_parts=loop.setup.world if chief else 0)
    dist.barrier()
    return destination


def unexpected_imports() -> list[str]:
    """Top-level modules imported that are neither the standard library, nor on the lent
    machine, nor carried (`make gpu-wheels`), nor ours, nor generated (inductor's kernels)."""
    allowed = set(sys.stdlib_module_names) | DEVICE_MODULES | carried_modules()
    allowed |= {"raytrain_lm", "gpu_mfu", "gpu_wheels", "__main__", "__mp_main__"}
    unexpected = set()
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in allowed or top.startswith("_") or module is None:
            continue
        where = str(getattr(module, "__file__", None) or "")
        if not where or "torchinductor" in where or "/setuptools/_vendor/" in where:
            continue  # built in, compiled by inductor, or what setuptools carries
        unexpected.add(top)
    return sorted(unexpected)


PARTS = {
    "a_gpt2_124m": part_a,
    "b_llama_fsdp": part_b,
    "c_checkpoint": part_c,
    "d_llama_hsdp": part_d,
    "e_llama_tensor_parallel": part_e,
}


def _chosen(name: str, wanted: str | None) -> bool:
    return wanted is None or any(w.strip() in (name, name[0]) for w in wanted.split(","))


def _passed(name: str, result: dict) -> bool:
    """No error, every `ok` it reports holds; (c) must have run (not skipped) and hold."""
    if "error" in result or result.get("ok") is False:
        return False
    return bool(result.get("ok")) if name == "c_checkpoint" else True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: the same code paths")
    p.add_argument("--out", default="gpu_check.json", help="where to write the results")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="parts start only within it")
    p.add_argument("--parts", help="only these, comma-separated (names or letters: b,d,e)")
    args = p.parse_args(argv)
    parts = [(name, part) for name, part in PARTS.items() if _chosen(name, args.parts)]
    if not parts:
        p.error(f"--parts {args.parts}: none of {', '.join(PARTS)}")
    started = time.time()
    out = Path(args.out)
    results: dict = {"dry_run": args.dry_run, "torch": torch.__version__}
    if not args.dry_run and not torch.cuda.is_available():
        results["error"] = "no CUDA GPU is visible: nothing measured"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(
            f"gpu_check: no CUDA GPU is visible to torch {torch.__version__} (CUDA build: "
            f"{torch.version.cuda or 'no'}); nothing measured. On CPU: --dry-run",
            file=sys.stderr,
        )
        return 2
    setup = Setup(args.dry_run)
    device = setup.device
    results["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results["world_size"] = setup.world
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for name, part in parts:
            t0 = time.time()
            if t0 - started > args.budget_s:
                results[name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            else:
                try:
                    results[name] = part(setup, Path(scratch)) if part is part_c else part(setup)
                except Exception as exc:  # the next part still runs, and this one says why
                    traceback.print_exc()
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                results[name]["wall_s"] = round(time.time() - t0, 1)
            if setup.rank == 0:
                print(f"gpu_check: {name}: {json.dumps(results[name])}", flush=True)
                out.write_text(json.dumps(results, indent=2) + "\n")
    results["unexpected_imports"] = unexpected_imports()
    results["wall_s"] = round(time.time() - started, 1)
    ok = not results["unexpected_imports"] and all(
        _passed(name, results[name]) for name, _ in parts
    )
    if setup.rank == 0:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"gpu_check: wrote {out} ({results['wall_s']} s); ok: {bool(ok)}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
