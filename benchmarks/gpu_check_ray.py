"""The Ray Train end-to-end check, for a GPU machine or cluster with the project installed
(`make install TORCH_SPEC=torch`: Ray, MLflow, a CUDA torch): our whole worker loop under Ray
Train, data streamed by Ray Data, tracked to MLflow, against a plain loop, in one run that
writes one JSON file. The lent GPU machine, which has no Ray, runs benchmarks/gpu_check.sh.

    .venv/bin/python benchmarks/gpu_check_ray.py [--dry-run] [--out gpu_check_ray.json]

(a) GPT-2 124M (bf16, compiled): tokens/s and MFU of our loop (Ray Train, 1 worker, data
    streamed from token shards) and of the plain loop (benchmarks/gpu_mfu.py: nanoGPT's
    recipe, one batch resident on the GPU), as a ratio;
(b) a Llama of about 350M parameters under FSDP on the one GPU: MFU;
(c) the demo config for 50 steps on the GPU, end to end: NCCL group, a checkpoint at step 25,
    a second invocation resuming from it; every step's host reads counted (count-syncs);
(d) peak GPU memory of each.

`--dry-run` runs the same code paths on CPU at toy sizes (what `make test` runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab": 50304}
TOY_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab": 512}
LLAMA_350M = [
    "model.n_layer=24", "model.n_head=16", "model.n_kv_head=8", "model.n_embd=1024",
    "model.block_size=1024", "model.vocab_size=32000",
]  # fmt: skip
TOY_LLAMA = [
    "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=64",
    "model.block_size=64", "model.vocab_size=512",
]  # fmt: skip


def _gpt_overrides(shape: dict) -> list[str]:
    return [
        "model.arch=gpt2",
        f"model.n_layer={shape['n_layer']}",
        f"model.n_head={shape['n_head']}",
        f"model.n_embd={shape['n_embd']}",
        f"model.block_size={shape['block_size']}",
        f"model.vocab_size={shape['vocab']}",
    ]


def _plain_loop(shape: dict, micro: int, accumulation: int, steps: int, warmup: int) -> dict:
    """benchmarks/gpu_mfu.py in its own process (beside Ray's workers), same shape and batch."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "gpu_mfu.py"),
        "--n-layer", str(shape["n_layer"]), "--n-head", str(shape["n_head"]),
        "--n-embd", str(shape["n_embd"]), "--block-size", str(shape["block_size"]),
        "--vocab-size", str(shape["vocab"]), "--micro-batch", str(micro),
        "--accumulation", str(accumulation), "--steps", str(steps), "--warmup", str(warmup),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"gpu_mfu.py failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("gpu_mfu: "))
    return json.loads(line.removeprefix("gpu_mfu: "))


class Runs:
    """Our runs, through the public API, sharing one Ray, one data cache and one MLflow."""

    def __init__(self, workdir: Path, dry_run: bool):
        self.workdir, self.dry_run = workdir, dry_run
        self.common = [
            f"output_dir={workdir / 'runs'}",
            f"data.cache_dir={workdir / 'data'}",
            f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}",
            "scaling.num_workers=1",
            "training.sample_tokens=0",
            # Ray Train acts on what it sees when it polls its workers (default every 2 s):
            # each start, checkpoint and end would wait for the next poll.
            "fault.health_check_s=0.25",
        ]
        if dry_run:  # a small corpus and no MLflow (seconds each run on 2 cores)
            self.common += [
                "data.sources=builtin:python-docs",
                "data.max_source_bytes=300000",
                "tracking.enabled=false",
            ]

    def train(self, name: str, overrides: list[str]) -> tuple[dict, dict]:
        import raytrain_lm
        from raytrain_lm.config import load_config

        cfg = load_config(None, [*self.common, f"name={name}", *overrides])
        summary = raytrain_lm.train(cfg, sample=False)
        if not cfg.tracking.enabled:
            return summary, {}
        history = raytrain_lm.metric_history(name, output_dir=self.workdir / "runs")
        return summary, history

    @staticmethod
    def figures(summary: dict, history, flops_per_token: float) -> dict:
        from raytrain_lm import devices

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tokens_per_s = summary["tokens_per_s"]
        peak = history["perf/memory_peak_gib"].max() if "perf/memory_peak_gib" in history else None
        return {
            "steps": summary["steps"],
            "tokens_per_s": round(tokens_per_s),
            "mfu": round(flops_per_token * tokens_per_s / devices.peak_flops(device), 4),
            "peak_memory_GiB": None if peak is None else round(float(peak), 2),
            "train_loss": round(summary["train_loss"], 4),
        }


def _flops_per_token(overrides: list[str]) -> float:
    from raytrain_lm.config import load_config
    from raytrain_lm.models import build_model

    cfg = load_config(None, overrides)
    with torch.device("meta"):
        return build_model(cfg.model, cfg.model.vocab_size or 257).flops_per_token()


def part_a(runs: Runs, dry_run: bool) -> dict:
    shape = TOY_GPT if dry_run else GPT2_124M
    micro, accumulation = (4, 2) if dry_run else (16, 4)
    steps, warmup = (8, 2) if dry_run else (40, 10)
    plain = _plain_loop(shape, micro, accumulation, steps, warmup)
    overrides = [
        *_gpt_overrides(shape),
        f"training.global_batch_size={micro * accumulation}",
        f"training.micro_batch_size={micro}",
        f"training.max_steps={steps + warmup}",
        f"training.eval_every={steps + warmup}",
        "training.eval_sequences=8",
        f"training.log_every={max(1, steps // 4)}",
    ]
    summary, history = runs.train("gpt2-124m", overrides)
    ours = runs.figures(summary, history, _flops_per_token(overrides))
    return {
        "model": f"gpt2 {plain['params_M']}M",
        "plain_loop": {k: plain[k] for k in ("tokens_per_s", "mfu", "peak_memory_GiB")},
        "ours": ours,
        "ours_over_plain": round(ours["tokens_per_s"] / plain["tokens_per_s"], 3),
        "bf16": plain["bf16"],
        "compiled": plain["compiled"],
    }


def part_b(runs: Runs, dry_run: bool) -> dict:
    overrides = [
        "model.arch=llama",
        *(TOY_LLAMA if dry_run else LLAMA_350M),
        "parallel.strategy=fsdp",
        f"training.global_batch_size={4 if dry_run else 32}",
        f"training.micro_batch_size={2 if dry_run else 8}",
        f"training.max_steps={6 if dry_run else 30}",
        "training.eval_sequences=8",
        f"training.log_every={2 if dry_run else 10}",
    ]
    summary, history = runs.train("llama-350m-fsdp", overrides)
    figures = runs.figures(summary, history, _flops_per_token(overrides))
    from raytrain_lm.config import load_config
    from raytrain_lm.models import parameter_count

    cfg = load_config(None, overrides)
    figures["params_M"] = round(parameter_count(cfg.model, cfg.model.vocab_size) / 1e6, 1)
    return figures


def part_c(runs: Runs, dry_run: bool) -> dict:
    """The embedded demo config on the GPU: 50 steps, as two invocations (stop at 25, resume)."""
    from raytrain_lm.run_events.journal import read_events
    from raytrain_lm.trainer.chaos import ENV_VAR

    steps = 6 if dry_run else 50
    half = steps // 2
    overrides = [f"training.max_steps={steps}"]
    os.environ[ENV_VAR] = "count-syncs"
    try:
        first, _ = runs.train("demo", [*overrides, f"training.stop_after_step={half}"])
        second, history = runs.train("demo", overrides)
    finally:
        del os.environ[ENV_VAR]
    events = read_events(runs.workdir / "runs" / "demo")
    restored = [e["restored_step"] for e in events if e["event"] == "segment_start"]
    syncs = [e for e in events if e["event"] == "host_syncs"]
    hot = sum(count for e in syncs for count in e["per_step"].values())
    ok = first["steps"] == half and second["steps"] == steps and restored == [0, half]
    return {
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
        "steps": second["steps"],
        "restored_steps": restored,
        "val_loss": round(second["val_loss"], 4),
        "host_syncs_in_hot_path": hot,
        "peak_memory_GiB": round(float(history["perf/memory_peak_gib"].max()), 2)
        if "perf/memory_peak_gib" in history
        else None,
        "ok": ok and hot == 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: the same code paths")
    p.add_argument("--out", default="gpu_check_ray.json", help="where to write the results")
    p.add_argument("--workdir", help="runs, data and MLflow (default: a temporary folder)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        workdir = Path(args.workdir or scratch).resolve()
        runs = Runs(workdir, args.dry_run)
        results: dict = {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dry_run": args.dry_run,
            "torch": torch.__version__,
        }
        for name, part in (("a_gpt2_124m", part_a), ("b_llama_fsdp", part_b), ("c_demo", part_c)):
            t0 = time.time()
            results[name] = part(runs, args.dry_run)
            results[name]["wall_s"] = round(time.time() - t0, 1)
            print(f"gpu_check: {name}: {json.dumps(results[name])}", flush=True)
        results["wall_s"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"gpu_check: wrote {args.out} ({results['wall_s']} s)")
    return 0 if results["c_demo"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
