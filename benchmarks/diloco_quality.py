"""What DiLoCo's sync costs in quality, side by side in one script: the same run (the test
suite's 2-layer model on Python's docs, 240 steps of 12 sequences, 2 workers) under every-step
DDP, DiLoCo at H=8 and Streaming DiLoCo at H=8 with 2 and 4 fragments; val loss at the end and
the gap to DDP's. Plain outer averaging (outer lr 1, no momentum) throughout, as
tests/test_diloco.py measures DiLoCo (docs/diloco.md says why at so small an H).

    .venv/bin/python benchmarks/diloco_quality.py     # about 3 minutes on 2 cores

Writes benchmarks/results/diloco_quality.json; docs/diloco.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import raytrain_lm  # noqa: E402
from raytrain_lm.clusters.multinode import TINY_MODEL  # noqa: E402
from raytrain_lm.config import load_config  # noqa: E402

DILOCO = [
    "scaling.fault_tolerance=replicas",
    "parallel.sync=diloco",
    "diloco.outer_lr=1",
    "diloco.outer_momentum=0",
]
SYNCS = {
    "every-step DDP": [],
    "DiLoCo H=8": [*DILOCO, "diloco.sync_every=8"],
    "Streaming H=8, F=2, K=2": [
        *DILOCO,
        "diloco.sync_every=8",
        "diloco.fragments=2",
        "diloco.full_sync_every=2",
    ],
    "Streaming H=8, F=4, K=4": [
        *DILOCO,
        "diloco.sync_every=8",
        "diloco.fragments=4",
        "diloco.full_sync_every=4",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="diloco-quality-"))
    common = [
        *TINY_MODEL,
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'data'}",
        "tracking.enabled=false",
        "training.global_batch_size=12",
        "training.micro_batch_size=1",
        "training.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "data.shuffle_window_shards=1",
        f"training.max_steps={args.steps}",
        f"training.eval_every={args.steps}",
        "training.eval_sequences=128",
        "training.ledger=false",
        "checkpoint.every_steps=100000",
        "scaling.num_workers=2",
    ]
    results: dict[str, float] = {}
    for index, (name, overrides) in enumerate(SYNCS.items()):
        cfg = load_config(None, [*common, *overrides, f"name=run-{index}"])
        results[name] = raytrain_lm.train(cfg, sample=False)["val_loss"]
    ddp = results["every-step DDP"]
    print(f"{'sync':<26} {'val loss':>9} {'gap to DDP':>11}")
    for name, loss in results.items():
        print(f"{name:<26} {loss:>9.4f} {loss / ddp - 1:>10.1%}")
    out = ROOT / "benchmarks" / "results" / "diloco_quality.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "val_loss": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
