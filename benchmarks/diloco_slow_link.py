"""DiLoCo against every-step sync between two replica groups a slow link apart (issue 33): wall
time to a target val loss, side by side in one script.

Two Ray nodes with one `trainslot` each, one per replica group (`scaling.fault_tolerance=
replicas`, one worker per group): the head and group 0's node in this network namespace, group
1's node (`ray start`, token auth) in a namespace of its own, joined to this one through an
emulated link (benchmarks/slow_link.py: 50 ms one way in each direction, so a 100 ms round
trip, and 100 Mbit/s each way, netem's `delay 50ms rate 100mbit limit 1000` on both ends; this
kernel has no netem). Everything between the groups crosses it: gradients or pseudo-gradients,
the quorums (the Lighthouse runs on the head), Ray's own traffic, the data group 1 reads. The
link's byte counters are reported beside the bytes counted at the collectives.

The same run under each sync (model, global batch, seed, data order, schedule), one after the
other on that cluster: by default DiLoCo at H=8 (outer momentum 0.5: the default 0.9 overshoots
at so small an H in so short a run) and at H=32 (the defaults), then every-step sync. Each is
evaluated every `--eval-every` steps (DiLoCo: at the first round end past each multiple). The
target is the highest of the runs' best val losses (or `--target`): all of them reach it. The
time to it counts from the start of training (both groups started; Ray's and the groups'
start-up are not counted) to the evaluation that reaches it, interpolated linearly in time from
the evaluation before. Every-step sync runs last and is stopped once it reaches the target
(`--full`: to the end). The model (0.83M parameters) and batch (256 tokens a step) are small
so that each run takes minutes on these CPU cores; a group's compute per step (tens of ms) is
then a fraction of an every-step all-reduce over the link (0.7 s), as a GPU step's is over a
WAN. docs/benchmarks.md has the figures.

    .venv/bin/python benchmarks/diloco_slow_link.py               # as root; about 9 minutes
    .venv/bin/python benchmarks/diloco_slow_link.py --steps 48 --configs diloco:8 every  # smoke

Root is needed for the namespace and the TUN devices. Writes
benchmarks/results/diloco_slow_link.json. Everything it starts (the namespace, the emulator and
its devices, the Ray nodes, the temporary directory) is removed on every way out, SIGTERM and
Ctrl-C included (the run in progress takes a second signal to end at once).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RUST_LOG", "warn")
# Token auth on every node, the far one included: a node without it is refused by the others.
os.environ["RAY_AUTH_MODE"] = "token"

from slow_link import SlowLink  # noqa: E402

import raytrain_lm  # noqa: E402
from raytrain_lm.clusters.multinode import SLOT, LocalCluster  # noqa: E402
from raytrain_lm.config import load_config  # noqa: E402
from raytrain_lm.run_events.journal import read_events  # noqa: E402
from raytrain_lm.rundir import RunDir  # noqa: E402
from raytrain_lm.trainer.components import stop_requests  # noqa: E402

EVERY = "every"
BLOCK = 64  # tokens per sequence


def model_overrides(args) -> list[str]:
    # gpt2 on bytes: 4 layers of width --n-embd, context 64 (0.82M parameters at 128).
    return [
        "model.n_layer=4",
        "model.n_head=4",
        f"model.n_embd={args.n_embd}",
        f"model.block_size={BLOCK}",
        "data.sources=builtin:python-docs",
        "data.max_source_bytes=1200000",
        f"training.global_batch_size={args.batch}",
        f"training.max_steps={args.steps}",
        f"training.eval_every={args.eval_every}",
        f"training.log_every={args.eval_every}",
        f"training.eval_sequences={args.eval_sequences}",
        f"optim.lr={args.lr}",
        "optim.warmup_steps=20",
        "training.precision=fp32",
        "training.progress=false",
        "training.sample_tokens=0",
    ]


def parse_config(text: str) -> tuple[str, int, list[str]]:
    """`every`, or `diloco:H` with optional `:key=value` diloco settings
    (`diloco:8:outer_lr=0.3`): the run's name, H (1 for every step) and its overrides."""
    if text == EVERY:
        return "every-step", 1, []
    kind, h, *settings = text.split(":")
    if kind != "diloco" or not h.isdigit():
        raise SystemExit(f"a config is 'every' or 'diloco:H[:key=value...]', not {text!r}")
    name = "-".join([f"diloco-h{h}", *(kv.replace("=", "") for kv in settings)])
    sync = ["parallel.sync=diloco", f"diloco.sync_every={h}"]
    return name, int(h), [*sync, *(f"diloco.{kv}" for kv in settings)]


def run_overrides(cluster: LocalCluster, workdir: Path, config: str, args) -> list[str]:
    name, _, sync = parse_config(config)
    return [
        *model_overrides(args),
        *cluster.overrides(),
        f"name={name}",
        f"output_dir={workdir / 'runs'}",
        f"data.cache_dir={workdir / 'data'}",
        f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}",
        "checkpoint.every_steps=100000",  # the final one only: no checkpoint inside a timing
        "scaling.fault_tolerance=replicas",
        "scaling.min_workers=2",
        "scaling.max_workers=2",
        "fault.max_failures=0",  # a group lost or replaced would time something else
        "fault.worker_start_timeout_s=120",  # a worker starting across the link takes seconds
        *sync,
    ]


def metric(uri: str, run_id: str, key: str) -> list[tuple[float, int, float]]:
    """(time, step, value) of every logged value of `key`, in step order."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted((m.timestamp / 1000, m.step, m.value) for m in history)


def watch(run_dir: Path, uri: str, target: float | None, done: threading.Event, seen: dict):
    """While a run trains: the machine's load (1-minute average) every 2 s into
    `seen["loads"]`, and with a `target`, a stop request once an evaluation reached it (its
    chief logs them to MLflow); `seen["stopped"]` says it asked."""
    import mlflow

    while not done.wait(2.0):
        seen["loads"].append(os.getloadavg()[0])
        if target is None or not run_dir.exists():
            continue
        runs = mlflow.search_runs(
            experiment_names=["raytrain-lm"],
            filter_string=f"tags.mlflow.runName = '{run_dir.name}'",
            output_format="list",
        )
        if runs and any(v <= target for _, _, v in metric(uri, runs[0].info.run_id, "val/loss")):
            stop_requests.request_stop(RunDir(str(run_dir)), "reached the target val loss")
            seen["stopped"], target = True, None


def train_one(link: SlowLink, cluster, workdir: Path, config: str, args, stop_target) -> dict:
    import mlflow

    name, sync_every, _ = parse_config(config)
    run_dir = workdir / "runs" / name
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    done, seen = threading.Event(), {"loads": [], "stopped": False}
    mlflow.set_tracking_uri(uri)
    watcher = threading.Thread(target=watch, args=(run_dir, uri, stop_target, done, seen))
    watcher.start()
    started, crossed = time.time(), link.bytes_crossed()
    try:
        cfg = load_config(None, run_overrides(cluster, workdir, config, args))
        summary = raytrain_lm.train(cfg, sample=False)
    finally:
        done.set()
        watcher.join()
    if summary["stopped"] and not seen["stopped"]:  # Ctrl-C or SIGTERM: the run took it
        raise SystemExit(f"{name} was stopped: the benchmark ends")
    crossed = {k: v - crossed[k] for k, v in link.bytes_crossed().items()}
    # Training starts when the later of the two groups has started (both are then in the
    # first quorum): the same origin under either sync.
    first = max(e["t"] for e in read_events(run_dir) if e["event"] == "replica_start")
    run_id = summary["mlflow_run_id"]
    vals = metric(uri, run_id, "val/loss")
    steps = metric(uri, run_id, "train/loss")
    last_t, last_step = steps[-1][0], steps[-1][1]
    tokens_per_step = args.batch * BLOCK
    bytes_per_token = metric(uri, run_id, "comm/bytes_per_token")
    tokens_per_s = metric(uri, run_id, "perf/tokens_per_s")
    return {
        "config": name,
        "sync_every": sync_every,
        "wall_s": round(time.time() - started, 1),
        "start_t": first,
        "val": [(round(t - first, 2), s, round(v, 4)) for t, s, v in vals],
        "final_val_loss": round(vals[-1][2], 4),
        "best_val_loss": round(min(v for _, _, v in vals), 4),
        "steps": last_step,
        # from the start to the last step, evaluations included
        "steps_per_s": round(last_step / max(1e-9, last_t - first), 3),
        # the logged intervals' pace, evaluations excluded (median)
        "train_steps_per_s": round(
            statistics.median(v for _, _, v in tokens_per_s) / tokens_per_step, 3
        ),
        "bytes_per_token": round(bytes_per_token[-1][2], 2) if bytes_per_token else None,
        # measured on the link, each way, start-up and the data group 1 read included
        "link_bytes_per_token": {
            k: round(v / (last_step * tokens_per_step), 1) for k, v in crossed.items()
        },
        "stopped": summary["stopped"],
        # this machine's 1-minute load average during the run (2 cores: above 2 is queueing)
        "load_avg": round(statistics.mean(seen["loads"]), 1) if seen["loads"] else None,
    }


def time_to(result: dict, target: float) -> dict:
    """Seconds and steps from the start of training to `target`, interpolated linearly between the
    last evaluation above it and the first at or below it; None if never reached."""
    previous = None
    for t, step, loss in result["val"]:
        if loss <= target:
            if previous is None or previous[2] == loss:
                return {"s": t, "step": step, "at_eval_s": t}
            f = (previous[2] - target) / (previous[2] - loss)
            return {
                "s": round(previous[0] + f * (t - previous[0]), 1),
                "step": round(previous[1] + f * (step - previous[1])),
                "at_eval_s": t,
            }
        previous = (t, step, loss)
    return {"s": None, "step": None, "at_eval_s": None}


def start_far_node(link: SlowLink, cluster: LocalCluster, log: Path) -> None:
    """Group 1's Ray node, inside the link's namespace, joining the head across the link."""
    import ray

    link.popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats",
         f"--address={cluster.address}", f"--node-ip-address={link.inner_ip}", "--num-cpus=1",
         f"--resources={json.dumps({SLOT: 1})}", f"--object-store-memory={200 << 20}",
         # its own logs, as on another machine (the head's log monitor reads the head's dir)
         f"--temp-dir={log.parent / 'far-ray'}"],
        stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        if any(n["Alive"] and n["NodeManagerAddress"] == link.inner_ip for n in ray.nodes()):
            return
        time.sleep(1)
    raise RuntimeError(f"the far node did not join within 120 s: see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["diloco:8:outer_momentum=0.5", "diloco:32", EVERY],
        help="'every' and/or 'diloco:H[:key=value...]' (diloco settings), run in this order; "
        "every-step last, so that it can stop at the target",
    )
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="global batch, in sequences of 64 tokens")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--eval-sequences", type=int, default=128)
    p.add_argument("--target", type=float, help="default: the highest best val loss of the runs")
    p.add_argument("--full", action="store_true", help="train every-step to the end too")
    p.add_argument("--delay-ms", type=float, default=50, help="one way, each direction")
    p.add_argument("--rate-mbit", type=float, default=100, help="each direction")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--keep", action="store_true", help="keep the runs (printed) after the end")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/diloco_slow_link.json"))
    args = p.parse_args()
    for config in args.configs:
        parse_config(config)  # refused before anything starts

    # SIGTERM (a CI timeout, `kill`) ends like Ctrl-C: through the finally blocks below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="diloco-slow-link-"))
    if not args.keep:
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    link = SlowLink(args.delay_ms, args.rate_mbit, mtu=args.mtu)
    cluster: LocalCluster | None = None

    def close() -> None:
        nonlocal cluster
        link.kill_inside()  # the far node first: it would wait for a head that went
        if cluster is not None:
            # Ray leaves its session's logs in /tmp/ray; this cluster's go with the run's
            # files (--keep keeps both)
            session = cluster.cluster.head_node.get_session_dir_path()
            cluster.shutdown()
            cluster = None
            if not args.keep:
                shutil.rmtree(session, ignore_errors=True)
        link.close()

    atexit.register(close)  # also when this process ends before the finally below runs
    print(f"runs, data and MLflow in {workdir}", flush=True)
    report: dict = {"args": vars(args), "link": {**link.shape}, "results": []}
    started = time.time()
    try:
        report["link"]["measured"] = [link.probe(n << 20) for n in (1, 4)]
        print(f"link: {json.dumps(report['link'])}", flush=True)
        cluster = LocalCluster(workers=1, node_ip=link.outer_ip)
        start_far_node(link, cluster, workdir / "far-node.log")
        best: list[float] = []
        for config in args.configs:
            stop = None
            if config == EVERY and not args.full and (args.target or best):
                stop = args.target or max(best)
            result = train_one(link, cluster, workdir, config, args, stop)
            best.append(result["best_val_loss"])
            report["results"].append(result)
            shown = {k: v for k, v in result.items() if k != "val"}
            print(f"{result['config']}: {json.dumps(shown)}", flush=True)
    finally:
        close()
    report["total_s"] = round(time.time() - started, 1)
    summarize(report, args.target)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


def summarize(report: dict, target: float | None) -> None:
    results = report["results"]
    target = target or max(r["best_val_loss"] for r in results)
    report["target_val_loss"] = target
    rows = {}
    for r in results:
        reach = time_to(r, target)
        rows[r["config"]] = {
            "time_to_target_s": reach["s"],
            "steps_to_target": reach["step"],
            "first_eval_at_target_s": reach["at_eval_s"],
            "steps_per_s": r["steps_per_s"],
            "bytes_per_token": r["bytes_per_token"],
            "link_bytes_per_token": r["link_bytes_per_token"],
            "final_val_loss": r["final_val_loss"],
            "steps": r["steps"],
            "load_avg": r["load_avg"],
        }
    every = rows.get("every-step", {}).get("time_to_target_s")
    for row in rows.values():
        if every and row["time_to_target_s"]:
            row["every_step_over_this"] = round(every / row["time_to_target_s"], 2)
    report["table"] = rows


if __name__ == "__main__":
    main()
