"""`scaling.fault_tolerance`: restart against replicas, side by side on one local multi-node Ray
(a head and single-slot worker nodes, raytrain_lm.clusters.multinode), in one script.

For each mode, the same seeded incident schedule on a 2-worker run (min 1, max 2) whose steps
are paced to `--step-s`: a node killed at `--kill-at` s into training, a node added `--add-after`
s later, and a spot notice (drain) on a node `--drain-after` s after that. Per incident:
- the survivors' stall: the longest gap between two of the surviving worker's steps around it
  (restart: the survivor restarts too, so from its last step before to its first after);
- the time back to full strength: from the incident until two workers train again;
- worker-seconds lost: the survivors' stall plus, under restart, the steps recomputed
  (steps since the last checkpoint, times the step time, times the workers);
and for the node added after the kill (`join`), what the worker already training lost to the
newcomer: under replicas its gap at the step the new group joined, under restart the time from
the node's arrival to the first step of the larger group.
Then, without incidents, tokens/s of the two modes over `--steps` unpaced steps, alternating.
The incidents are spaced so that each one meets a run that trains (restart mode needs 17 to 36 s
to come back here); a drain that lands while restart mode is still placing a larger group
was seen to leave that group waiting for the drained node.

    .venv/bin/python benchmarks/replicas_vs_restart.py --rounds 2
    .venv/bin/python benchmarks/replicas_vs_restart.py --rounds 0   # incidents only
    .venv/bin/python benchmarks/replicas_vs_restart.py --throughput-only --model demo --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RUST_LOG", "warn")

import raytrain_lm  # noqa: E402
from raytrain_lm.clusters.multinode import (  # noqa: E402
    TINY_MODEL,
    Background,
    LocalCluster,
    wait_for_event,
)
from raytrain_lm.config import load_config  # noqa: E402
from raytrain_lm.run_events.journal import read_events  # noqa: E402
from raytrain_lm.trainer import chaos  # noqa: E402

BATCH = 12


def common(cluster: LocalCluster, workdir: Path, mode: str, model: str = "tiny") -> list[str]:
    # demo: the embedded defaults' model and global batch (32), the job `make demo` runs.
    sized = [*TINY_MODEL, f"training.global_batch_size={BATCH}"] if model == "tiny" else []
    return [
        *sized,
        *cluster.overrides(),
        f"output_dir={workdir / 'runs'}",
        f"data.cache_dir={workdir / 'data'}",
        "tracking.enabled=false",
        "training.eval_every=100000",
        "training.precision=fp32",
        "checkpoint.every_steps=50",
        "data.shuffle_window_shards=1",
        "fault.health_check_s=0.25",
        "fault.max_failures=-1",
        f"scaling.fault_tolerance={mode}",
        "scaling.min_workers=1",
        "scaling.max_workers=2",
    ]


def incident_run(cluster: LocalCluster, workdir: Path, mode: str, args) -> dict:
    """One run under the incident schedule; the times of what happened, from its events."""
    name = f"incidents-{mode}"
    run_dir = workdir / "runs" / name
    overrides = [
        *common(cluster, workdir, mode),
        f"name={name}",
        f"training.max_steps={args.max_steps}",
    ]
    os.environ[chaos.ENV_VAR] = f"slow-steps:seconds={args.step_s}"
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))
    first = wait_for_event(
        run_dir, lambda e: e["event"] in ("first_step", "replicas_changed"), 600, still_running=run
    )
    time.sleep(args.kill_at)
    times = {"kill": time.time()}
    cluster.kill_node()
    time.sleep(args.add_after)
    times["add"] = time.time()
    cluster.add_node()
    time.sleep(args.drain_after)
    times["drain"] = time.time()
    drained = cluster.drain_node(deadline_s=120)
    summary = run.wait(900)
    cluster.kill_node(drained)  # the cloud takes the machine at its deadline
    del os.environ[chaos.ENV_VAR]
    (run_dir / "incident_times.json").write_text(json.dumps(times))
    events = read_events(run_dir)
    return {"mode": mode, "summary": summary, "times": times, "events": events, "t0": first["t"]}


def remeasure(workdir: Path, step_s: float) -> dict:
    """The incidents measured again from a finished run's events and times (`--remeasure`)."""
    out = {}
    for mode in ("restart", "replicas"):
        run_dir = workdir / "runs" / f"incidents-{mode}"
        times = json.loads((run_dir / "incident_times.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        result = {"mode": mode, "summary": summary, "times": times, "events": read_events(run_dir)}
        out[mode] = measure(result, step_s)
    return out


def measure(result: dict, step_s: float) -> dict:
    """Per incident: stall, time to full strength, worker-seconds lost."""
    events, times, mode = result["events"], result["times"], result["mode"]
    out = {}
    for incident in ("kill", "drain"):
        t = times[incident]
        if mode == "replicas":
            after = [e for e in events if e["event"] == "replicas_changed" and e["t"] >= t]
            drop = next((e for e in after if e["participants"] < e["previous"]), None)
            back = next(
                (e for e in after if drop and e["t"] > drop["t"] and e["participants"] == 2), None
            )
            stall = max(
                (e["gap_s"] for e in after if drop and e["step"] == drop["step"]), default=0
            )
            full = (back["t"] - t) if back else None
            recomputed = 0
        else:
            restarts = [e for e in events if e["event"] == "segment_start" and e["t"] >= t]
            firsts = [e for e in events if e["event"] == "first_step" and e["t"] >= t]
            # The group the incident ended: the first end after it, and the restart after that.
            ended = next((e for e in events if e["event"] == "segment_end" and e["t"] >= t), None)
            stall = (firsts[0]["t"] - t) if firsts else None
            grown = next((s for s in restarts if s["world_size"] == 2), None)
            first_after_grow = next((f for f in firsts if grown and f["t"] >= grown["t"]), None)
            full = (first_after_grow["t"] - t) if first_after_grow else None
            restart = next((s for s in restarts if ended and s["t"] >= ended["t"]), None)
            recomputed = max(0, ended["step"] - restart["restored_step"]) if restart else 0
        lost = (stall or 0) + recomputed * step_s * 2
        out[incident] = {
            "stall_s": round(stall, 2) if stall is not None else None,
            "full_strength_s": round(full, 2) if full is not None else None,
            "steps_recomputed": recomputed,
            "worker_s_lost": round(lost, 2),
        }
    out["join"] = _join(events, times["add"], mode)
    goodput = result["summary"]["goodput"]
    out["productive_ratio"] = goodput["productive_ratio"]
    return out


def _join(events: list[dict], t: float, mode: str) -> dict:
    """The node added after the kill: what the worker already training lost to the newcomer.
    Replicas: the survivor's gap at the step the replacement group joined (the newcomer's own
    gap is its start; goodput counts the same as replica_join_stall_s). Restart: a resize
    restart, from the node's arrival to the first step of the larger group."""
    if mode == "replicas":
        grew = next(
            (
                e
                for e in events
                if e["event"] == "replicas_changed"
                and e["t"] >= t
                and e["participants"] > e["previous"]
            ),
            None,
        )
        stayed = [
            e["gap_s"]
            for e in events
            if grew and e["event"] == "replicas_changed" and e["step"] == grew["step"]
            and not e.get("joined")
        ]  # fmt: skip
        stall = max(stayed, default=None)
    else:
        grown = next(
            (e for e in events if e["event"] == "segment_start" and e["t"] >= t
             and e["world_size"] == 2),
            None,
        )  # fmt: skip
        first = next(
            (e for e in events if grown and e["event"] == "first_step" and e["t"] >= grown["t"]),
            None,
        )
        stall = first["t"] - t if first else None
    return {
        "stall_s": round(stall, 2) if stall is not None else None,
        "worker_s_lost": round(stall, 2) if stall is not None else None,
    }


def throughput(cluster: LocalCluster, workdir: Path, mode: str, args, round_: int) -> float:
    name = f"speed-{args.model}-{mode}-{round_}"
    overrides = [
        *common(cluster, workdir, mode, args.model),
        f"name={name}",
        f"training.max_steps={args.steps}",
    ]
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    return summary["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds per mode")
    p.add_argument("--steps", type=int, default=300, help="unpaced steps per throughput run")
    p.add_argument(
        "--model",
        choices=("tiny", "demo"),
        default="tiny",
        help="the throughput runs' model: the tests' tiny one (18 ms steps here) or the demo's",
    )
    p.add_argument("--throughput-only", action="store_true", help="no incident runs")
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--kill-at", type=float, default=8.0)
    p.add_argument("--add-after", type=float, default=35.0)
    p.add_argument("--drain-after", type=float, default=45.0)
    p.add_argument("--out", help="default: benchmarks/results/replicas_vs_restart[_MODEL].json")
    p.add_argument("--remeasure", metavar="WORKDIR", help="measure a finished run's incidents")
    args = p.parse_args()
    if args.remeasure:
        print(json.dumps(remeasure(Path(args.remeasure), args.step_s), indent=2))
        return
    suffix = "" if args.model == "tiny" and not args.throughput_only else f"_{args.model}"
    args.out = args.out or f"benchmarks/results/replicas_vs_restart{suffix}.json"
    workdir = Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    cluster = LocalCluster(workers=2)
    report: dict = {
        "model": args.model,
        "incidents": {},
        "tokens_per_s": {"restart": [], "replicas": []},
    }
    try:
        for mode in () if args.throughput_only else ("restart", "replicas"):
            while len(cluster.nodes) < 2:
                cluster.add_node()
            result = incident_run(cluster, workdir, mode, args)
            report["incidents"][mode] = measure(result, args.step_s)
            print(f"{mode}: {json.dumps(report['incidents'][mode])}", flush=True)
        for round_ in range(args.rounds):
            for mode in ("restart", "replicas") if round_ % 2 == 0 else ("replicas", "restart"):
                while len(cluster.nodes) < 2:
                    cluster.add_node()
                rate = throughput(cluster, workdir, mode, args, round_)
                report["tokens_per_s"][mode].append(round(rate))
                print(f"round {round_} {mode}: {rate:,.0f} tokens/s", flush=True)
    finally:
        cluster.shutdown()
    speeds = report["tokens_per_s"]
    if args.rounds:
        report["replicas_over_restart"] = round(
            statistics.median(speeds["replicas"]) / statistics.median(speeds["restart"]), 3
        )
    for incident in ("kill", "join", "drain") if report["incidents"] else ():
        restart, replicas = (report["incidents"][m][incident] for m in ("restart", "replicas"))
        if replicas["worker_s_lost"] and restart["worker_s_lost"] is not None:
            report[f"{incident}_worker_s_lost_ratio"] = round(
                restart["worker_s_lost"] / replicas["worker_s_lost"], 2
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "incidents"}, indent=2))


if __name__ == "__main__":
    main()
