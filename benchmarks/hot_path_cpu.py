"""CPU tokens/s of the training loop before and after a change (issue 18: no per-step host
sync), measured side by side: the same 2-worker run from a git worktree of BEFORE and from
this tree, alternating (A, B, A, B, ...) so that machine noise hits both.

    .venv/bin/python benchmarks/hot_path_cpu.py --before 8357b42 [--rounds 3] [--steps 60]

Each figure is the run's steady tokens/s from its summary (the first steps are excluded);
the ratio after/before should be about 1: on CPU the device is the host, so there was no
queue to stall, and the change must cost nothing here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import json, sys
import raytrain_lm
from raytrain_lm.config import load_config
summary = raytrain_lm.train(load_config(None, sys.argv[1:]), sample=False)
print("summary: " + json.dumps(summary))
"""


def run(tree: Path, work: Path, name: str, steps: int) -> float:
    overrides = [
        f"name={name}",
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        "data.sources=builtin:python-docs",
        "data.max_source_bytes=2000000",
        f"training.max_steps={steps}",
        f"training.eval_every={steps}",
        f"checkpoint.every_steps={steps}",
        "training.eval_sequences=16",
        "training.sample_tokens=0",
        "training.progress=false",
    ]
    # The tree's own package first: its Ray workers inherit the path.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", RUN, *overrides], cwd=tree, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith("summary: "))
    return json.loads(line.removeprefix("summary: "))["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="the commit to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hot-path-") as scratch:
        work = Path(scratch)
        before = work / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before],
            check=True,
            capture_output=True,
        )
        try:
            figures: dict[str, list[float]] = {"before": [], "after": []}
            for i in range(args.rounds):
                for label, tree in (("before", before), ("after", ROOT)):
                    figures[label].append(run(tree, work, f"{label}-{i}", args.steps))
                    print(f"round {i} {label}: {figures[label][-1]:,.0f} tokens/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)])
    ratios = [a / b for a, b in zip(figures["after"], figures["before"], strict=True)]
    print(
        json.dumps(
            {
                "before_tokens_per_s": [round(x) for x in figures["before"]],
                "after_tokens_per_s": [round(x) for x in figures["after"]],
                "after_over_before": [round(r, 3) for r in ratios],
                "median_ratio": round(statistics.median(ratios), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
