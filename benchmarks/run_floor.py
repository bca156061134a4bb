"""What one Ray Train run costs before it trains anything: a 1-step run against a many-step run
of the suite's tiny model, side by side in one process and one Ray (issue 45's suite time).

    .venv/bin/python benchmarks/run_floor.py [--rounds 3] [--steps 48]

Both runs are the tests' tiny gpt2 on 2 DDP workers (tests/conftest.py's TINY settings), with
an evaluation and a checkpoint at their last step, on a local Ray started as the suite starts
its own (6 logical CPUs). After one warm-up run (the data prepared, the MLflow store created),
the script alternates them (1 step, N steps, 1 step, ...) so that the machine's noise hits
both. For each it measures the wall time and the machine's CPU time (every process: the
driver, Ray's controller, helper actors and Ray Data readers, the Train workers), read from
/proc/stat. On 2 cores the ratio of the two is near 1: a tiny run's cost is the processes Ray
starts for it (each imports Python, Ray and, for the workers, torch), not its steps. The
suite's time is bounded below by that floor times its number of runs (docs/development.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_cpu_s() -> float:
    """Seconds the machine's CPUs spent on anything but idling, since boot (guest time is
    already inside user and nice)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(v) for v in stat.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed_run(work: Path, name: str, steps: int, tiny: list[str]) -> tuple[float, float]:
    import raytrain_lm
    from raytrain_lm.config import load_config

    overrides = [
        *tiny,
        f"name={name}",
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"training.max_steps={steps}",
        f"training.eval_every={steps}",
        f"checkpoint.every_steps={steps}",
    ]
    cpu, wall = busy_cpu_s(), time.monotonic()
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    assert summary["steps"] == steps, summary
    return time.monotonic() - wall, busy_cpu_s() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY  # the suite's own tiny settings, not a copy of them

    from raytrain_lm.runtime import init_local_ray

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    init_local_ray(num_cpus=6, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="run-floor-"))
    timed_run(work, "warm-up", 1, TINY)
    measured: dict[int, list[tuple[float, float]]] = {1: [], args.steps: []}
    for round_ in range(args.rounds):
        for steps in (1, args.steps):
            wall, cpu = timed_run(work, f"r{round_}-{steps}", steps, TINY)
            measured[steps].append((wall, cpu))
            print(f"round {round_}, {steps:3d} steps: wall {wall:5.1f} s, CPU {cpu:5.1f} s")

    def median(steps: int, index: int) -> float:
        return statistics.median(m[index] for m in measured[steps])

    print(f"\n{os.cpu_count()} cores; medians of {args.rounds} rounds")
    for steps in measured:
        print(f"{steps:3d} steps: wall {median(steps, 0):5.1f} s, CPU {median(steps, 1):5.1f} s")
    ratio = median(args.steps, 1) / median(1, 1)
    print(f"CPU of {args.steps} steps / CPU of 1 step: {ratio:.2f}")


if __name__ == "__main__":
    main()
