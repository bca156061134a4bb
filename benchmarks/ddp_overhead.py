"""Speed of our Ray Train loop against plain PyTorch, as ratios measured side by side.

1. 2-worker Ray Train DDP (`raytrain_lm.train`, Ray Data streaming, MLflow on) against
   `torchrun --nproc_per_node 2` plain DDP on the same model, global batch and data.
2. 1-worker Ray Train loop against a nanoGPT-style single-process loop.

Runs alternate (A, B, A, B, ...) in one script so machine noise hits both; each figure is
steady-state tokens/s (the first steps are excluded on both sides). Goal: ratios >= 0.95.

    .venv/bin/python benchmarks/ddp_overhead.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from nanogpt_reference import Recipe, train_reference

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.data.manifest import read_shard
from raytrain_lm.data.prepare import prepare

HERE = Path(__file__).resolve().parent
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256}


def ours(
    work: Path,
    name: str,
    workers: int,
    cpus_per_worker: int,
    steps: int,
    batch: int,
    extra: tuple[str, ...] = (),
) -> float:
    overrides = [
        f"name={name}",
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        *(f"model.{k}={v}" for k, v in MODEL.items()),
        f"training.global_batch_size={batch}",
        f"training.max_steps={steps}",
        f"training.eval_every={steps}",
        f"checkpoint.every_steps={steps}",
        "training.eval_sequences=16",
        "training.sample_tokens=0",
        "training.progress=false",
        f"scaling.num_workers={workers}",
        f"scaling.cpus_per_worker={cpus_per_worker}",
        "optim.warmup_steps=5",
        *extra,
    ]
    return raytrain_lm.train(load_config(None, overrides), sample=False)["tokens_per_s"]


def torchrun(work: Path, data_dir: Path, steps: int, batch: int) -> float:
    out = work / "torchrun.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "torchrun_ddp.py"),
        "--data",
        str(data_dir),
        "--out",
        str(out),
        "--n-layer",
        str(MODEL["n_layer"]),
        "--n-head",
        str(MODEL["n_head"]),
        "--n-embd",
        str(MODEL["n_embd"]),
        "--block-size",
        str(MODEL["block_size"]),
        "--global-batch",
        str(batch),
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return json.loads(out.read_text())["tokens_per_s"]


def single_process(data_dir: Path, steps: int, batch: int, vocab: int, prepared) -> float:
    import torch

    torch.set_num_threads(2)
    train = np.concatenate(
        [read_shard(prepared.directory, s) for s in prepared.manifest.splits["train"].shards]
    )
    recipe = Recipe(
        n_layer=MODEL["n_layer"],
        n_head=MODEL["n_head"],
        n_embd=MODEL["n_embd"],
        block_size=MODEL["block_size"],
        batch_size=batch,
        max_iters=steps,
        warmup_iters=5,
        lr_decay_iters=steps,
        eval_interval=0,
    )
    return train_reference(train, train[:10_000], vocab, recipe)["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    import ray

    work = Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    ray.init(
        address="local", num_cpus=4, log_to_driver=False
    )  # before prepare, which would start its own
    cfg = load_config(None, [f"data.cache_dir={work / 'data'}"])
    prepared = prepare(cfg.data)
    pairs: dict[str, list[tuple[float, float]]] = {"ddp2": [], "single": []}
    for r in range(args.rounds):
        stamp = f"{r}-{int(time.time())}"
        a = ours(work, f"ddp2-{stamp}", 2, 1, args.steps, args.batch)
        b = torchrun(work, prepared.directory, args.steps, args.batch)
        pairs["ddp2"].append((a, b))
        c = ours(work, f"single-{stamp}", 1, 2, args.steps, args.batch)
        d = single_process(
            prepared.directory, args.steps, args.batch, prepared.manifest.vocab_size, prepared
        )
        pairs["single"].append((c, d))
        print(
            f"round {r}: ray 2w {a:,.0f} vs torchrun {b:,.0f} tok/s ({a / b:.3f}); "
            f"ray 1w {c:,.0f} vs plain {d:,.0f} tok/s ({c / d:.3f})",
            flush=True,
        )
    result = {
        name: {
            "ours_tokens_per_s": statistics.median(x for x, _ in v),
            "baseline_tokens_per_s": statistics.median(y for _, y in v),
            "ratio_median": statistics.median(x / y for x, y in v),
            "ratios": [round(x / y, 4) for x, y in v],
        }
        for name, v in pairs.items()
    }
    print("overhead: " + json.dumps(result))


if __name__ == "__main__":
    main()
