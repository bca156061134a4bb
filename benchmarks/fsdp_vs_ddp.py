"""FSDP against DDP: tokens/s of our 2-worker run under each strategy, side by side.

The same run (`raytrain_lm.train`: Ray Train, gloo, Ray Data streaming, MLflow on) as in
ddp_overhead.py, once with `parallel.strategy=ddp` and once with `fsdp`, alternating in one
script so machine noise hits both; steady-state tokens/s (first steps excluded). On CPU with
gloo, FSDP's all-gathers and reduce-scatters per block cost more than DDP's one all-reduce:
the ratio says how much. (On GPUs see gpu_mfu.py --strategy fsdp.)

    .venv/bin/python benchmarks/fsdp_vs_ddp.py [--rounds 3] [--steps 40] [--arch gpt2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ddp_overhead import ours

from raytrain_lm.config import load_config
from raytrain_lm.data.prepare import prepare


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    args = parser.parse_args()
    import ray

    work = Path(tempfile.mkdtemp(prefix="raytrain-bench-"))
    ray.init(address="local", num_cpus=4, log_to_driver=False)  # before prepare starts one
    prepare(load_config(None, [f"data.cache_dir={work / 'data'}"]).data)
    pairs = []
    for r in range(args.rounds):
        stamp = f"{r}-{int(time.time())}"
        speed = {
            strategy: ours(
                work,
                f"{strategy}-{stamp}",
                2,
                1,
                args.steps,
                args.batch,
                (f"parallel.strategy={strategy}", f"model.arch={args.arch}"),
            )
            for strategy in ("ddp", "fsdp")
        }
        pairs.append((speed["fsdp"], speed["ddp"]))
        print(
            f"round {r}: fsdp {speed['fsdp']:,.0f} vs ddp {speed['ddp']:,.0f} tok/s "
            f"({speed['fsdp'] / speed['ddp']:.3f})",
            flush=True,
        )
    result = {
        "arch": args.arch,
        "fsdp_tokens_per_s": statistics.median(f for f, _ in pairs),
        "ddp_tokens_per_s": statistics.median(d for _, d in pairs),
        "ratio_median": statistics.median(f / d for f, d in pairs),
        "ratios": [round(f / d, 4) for f, d in pairs],
    }
    print("fsdp_vs_ddp: " + json.dumps(result))


if __name__ == "__main__":
    main()
