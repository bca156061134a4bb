"""Speed of `scaling.balance: auto` against equal shares when one rank is slow, side by side in
one process and one Ray (issue 17).

    .venv/bin/python benchmarks/balance_cpu.py [--rounds 2] [--factor 2 3] [--steps 40] [--replicas]

Two workers on simulated devices (`RAYTRAIN_LM_FAULT=device-time:seconds=S:rank=1:factor=F`,
trainer/chaos.py): each forward pass takes S seconds per sequence longer and each backward 2S,
slept by the host as it waits for a GPU, and rank 1's F times as long, as a slower GPU type
beside a faster one. The tiny model's own work is small beside it: on these 2 shared cores,
real work slowed down would measure the machine's load more than the plan (tried first: the
ratio swung from 0.9x to 1.4x between rounds). For each factor the script alternates
`balance=none` and `balance=auto` runs (none, auto, none, auto, ...) so that the machine's noise
hits both, and compares their steady step time: the mean `perf/step_time_s` of the intervals
after step 15 (auto re-plans at step 8; the first intervals after it restart the data stream).
The ideal ratio, for the simulated time alone, is (1 + F) / 2 (equal shares take F units per
step, balanced ones 2F / (1 + F)); the model's own work, the optimizer and the all-reduce are
the same either way and pull the measured ratio below it.

`--replicas`: the two workers are replica groups (`scaling.fault_tolerance=replicas`), which
agree their shares before every step from the speeds each group measured and declared
(trainer/groups/speeds.py); their declarations, too, come at step 8.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

MODEL = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "training.global_batch_size=32",
    "training.log_every=5",
    "training.eval_sequences=16",
    "training.sample_tokens=0",
    "training.progress=false",
    "data.sources=builtin:python-docs",
    "data.max_source_bytes=1000000",
    "fault.health_check_s=0.25",
]


def steady_step_s(
    work: Path, name: str, balance: str, steps: int, mode: list[str]
) -> tuple[float, list, float]:
    import raytrain_lm
    from raytrain_lm.config import load_config

    overrides = [
        *MODEL,
        f"name={name}",
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"training.max_steps={steps}",
        f"training.eval_every={steps}",
        f"checkpoint.every_steps={steps}",
        f"scaling.balance={balance}",
        *mode,
    ]
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    history = raytrain_lm.metric_history(name, output_dir=work / "runs")
    intervals = history["perf/step_time_s"].dropna()
    steady = intervals[intervals.index > 15]
    return float(steady.mean()), summary["shares"], float(summary["train_loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--factor", type=float, nargs="+", default=[2.0, 3.0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seconds", type=float, default=0.003, help="simulated s/sequence, forward")
    p.add_argument("--replicas", action="store_true", help="the workers as replica groups")
    args = p.parse_args()
    mode = ["scaling.fault_tolerance=replicas", "scaling.num_workers=2"] if args.replicas else []

    from raytrain_lm.runtime import init_local_ray
    from raytrain_lm.trainer.chaos import ENV_VAR

    init_local_ray(num_cpus=6, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="balance-bench-"))
    rows = []
    for factor in args.factor:
        os.environ[ENV_VAR] = f"device-time:seconds={args.seconds:g}:rank=1:factor={factor:g}"
        ratios = []
        for round_ in range(args.rounds):
            stamp = int(time.time())
            none_s, _, none_loss = steady_step_s(
                work, f"n{factor:g}-{stamp}", "none", args.steps, mode
            )
            auto_s, shares, auto_loss = steady_step_s(
                work, f"a{factor:g}-{stamp}", "auto", args.steps, mode
            )
            ratios.append(none_s / auto_s)
            print(
                f"factor {factor:g} round {round_}: step time none {none_s:.3f} s, auto "
                f"{auto_s:.3f} s (shares {shares}), speed-up {none_s / auto_s:.2f}x; final "
                f"train loss none {none_loss:.6f}, auto {auto_loss:.6f}",
                flush=True,
            )
        rows.append((factor, statistics.median(ratios), (1 + factor) / 2))
    print("\n| slow rank | speed-up auto/none (median) | ideal |\n| --- | --- | --- |")
    for factor, ratio, ideal in rows:
        print(f"| {factor:g}x slower | {ratio:.2f}x | {ideal:.2f}x |")


if __name__ == "__main__":
    main()
