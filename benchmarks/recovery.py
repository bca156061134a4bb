"""Recovery after a node loss, and steps lost per preemption, on a local multi-node Ray.

Node loss: a 3-node elastic run (min 2, max 3) loses a node mid-run. From the run's event log
the recovery is split into
  detection     kill -> Ray Train's controller sees the failure (FailureEvents callback)
  rescheduling  -> the new, smaller worker group starts its training function
  restore       -> checkpoint loaded and data pipeline set up
  first step    -> the first optimizer step of the new group finishes
Preemption: a node is drained with a deadline (a spot notice) and removed at the deadline,
once with the just-in-time checkpoint and once without (Ray's default path: the run keeps
stepping until the node is gone and restarts from its last periodic checkpoint). Wasted
steps = steps recomputed after the restart.

    .venv/bin/python benchmarks/recovery.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import raytrain_lm  # noqa: E402
from raytrain_lm.clusters.multinode import (  # noqa: E402
    TINY_MODEL,
    Background,
    LocalCluster,
    segments,
    wait_for_event,
)
from raytrain_lm.config import load_config  # noqa: E402
from raytrain_lm.run_events.journal import read_events  # noqa: E402

TINY = [
    *TINY_MODEL,
    "training.global_batch_size=12",
    "training.eval_every=100000",
    "tracking.enabled=false",
    "scaling.min_workers=2",
    "scaling.max_workers=3",
]


def _run(cluster: LocalCluster, root: Path, name: str, extra: list[str]) -> Background:
    overrides = [
        *TINY,
        *cluster.overrides(),
        f"name={name}",
        f"output_dir={root / 'runs'}",
        f"data.cache_dir={root / 'data'}",
        *extra,
    ]
    return Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))


def node_loss(cluster: LocalCluster, root: Path, name: str) -> dict[str, float]:
    run = _run(cluster, root, name, ["training.max_steps=1200", "checkpoint.every_steps=20"])
    run_dir = root / "runs" / name
    wait_for_event(run_dir, lambda e: e["event"] == "first_step", 240, still_running=run)
    time.sleep(5)
    killed = time.time()
    cluster.kill_node()
    new = wait_for_event(
        run_dir,
        lambda e: e["event"] == "segment_start",
        180,
        after=killed,
        still_running=run,
    )
    first = wait_for_event(
        run_dir,
        lambda e: e["event"] == "first_step" and e["segment"] == new["segment"],
        120,
        still_running=run,
    )
    detected = next(
        e for e in read_events(run_dir) if e["event"] == "failure_detected" and e["t"] >= killed
    )
    cluster.add_node()
    run.wait(900)
    return {
        "detection": detected["t"] - killed,
        "rescheduling": new["t_start"] - detected["t"],
        "restore": new["t_restored"] - new["t_start"],
        "first_step": first["t"] - new["t_restored"],
        "total": first["t"] - killed,
    }


def preemption(cluster: LocalCluster, root: Path, name: str, jit: bool) -> dict[str, float]:
    run = _run(
        cluster,
        root,
        name,
        [
            "training.max_steps=1200",
            "checkpoint.every_steps=200",
            f"fault.checkpoint_on_preemption={str(jit).lower()}",
        ],
    )
    run_dir = root / "runs" / name
    wait_for_event(run_dir, lambda e: e["event"] == "first_step", 240, still_running=run)
    time.sleep(8)
    deadline_s = 15.0
    node = cluster.drain_node(deadline_s=deadline_s)
    drained = time.time()
    time.sleep(max(0.0, drained + deadline_s - time.time()))
    if node in cluster.nodes:
        cluster.kill_node(node)  # the cloud takes the machine at the deadline
    summary = run.wait(900)
    cluster.add_node()
    return {
        "steps_recomputed": summary["goodput"]["steps_recomputed"],
        "recovery_s": summary["goodput"]["recovery_s"],
        "restarts": summary["goodput"]["restarts"],
        "worker_groups": len(segments(run_dir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=["node-loss", "drain"])
    args = parser.parse_args()
    cluster = LocalCluster(workers=3)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            rounds = 0 if args.only == "drain" else args.rounds
            losses = [node_loss(cluster, root, f"loss-{i}") for i in range(rounds)]
            for key in losses[0] if losses else []:
                values = [round(x[key], 1) for x in losses]
                print(f"node loss {key:>12}: median {statistics.median(values):5.1f} s  {values}")
            for jit in (True, False) if args.only != "node-loss" else ():
                result = preemption(cluster, root, f"drain-{'jit' if jit else 'nojit'}", jit)
                label = "with just-in-time checkpoint" if jit else "without (Ray default)"
                print(f"drain {label}: {result}")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
