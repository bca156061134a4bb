"""Run state in a bucket (issue 15): what keeping checkpoints and prepared data in a bucket
costs against local disk, measured side by side in one script (rounds alternate the arms).

The bucket is the tests' S3-protocol server (moto, `tests/support/s3_server.py`), started in a
child process on 127.0.0.1 so that its work is not done under this process's GIL; it logs
every object request (start, end, method, key) to a file, and its CPU seconds are read from
/proc. Clients reach it the standard way (`AWS_ENDPOINT_URL` and credentials in the
environment, exported before Ray starts so that workers inherit them).

moto answers a ranged GET by reading the whole object and slicing it (`S3Response.key_response`
-> `FakeKey.value`, then `_handle_range_header`), so reading an object in 1 MB ranges, as
`pyarrow.fs.copy_files` does, costs time quadratic in its size: restoring the ~100M model's
1.2 GB checkpoint took about 600 s that way. S3 serves a range at the cost of the range; the
child therefore reads only the requested bytes for `Range: bytes=A-B` GETs (`--moto-as-is`
turns that off). Nothing else of moto is changed.

1. checkpoint save and restore, bucket vs local disk, for the demo model and a ~100M-parameter
   model, through the trainer's own calls: `save_checkpoint` to a local folder, then
   `upload_checkpoint` into the run directory (a local folder, or the bucket); restore is
   `RunDir.checkpoint_folders` + `restore_newest` (what `Worker.restore` does: list, verify the
   marker, download, check every file's SHA-256, load model and optimizer).
2. step time while a checkpoint uploads: short `raytrain_lm.train` runs (1 worker with 2 CPUs,
   demo model unless `--train-model`, eval only at the end), in three arms:
   `bucket+ckpt` (run directory and prepared data in the bucket, a checkpoint every `--every`
   steps, uploaded in the background: Ray Train's ASYNC mode), `bucket` (the same with no
   checkpoint before the last step) and `disk+ckpt` (as `bucket+ckpt` on local disk). Steps
   whose interval overlaps an upload (the server's request log gives each checkpoint's first
   request and the end of its COMPLETE marker's PUT; MLflow's per-step `perf/step_time_s` and
   timestamps give each step's interval) are compared with the `bucket` run's steps. Goal:
   <= 1.1x. Step time leaves out what a checkpoint does on the training thread (the loop
   restarts its step clock after a report), so that pause (checkpoint step's metrics -> next
   step's start: local write, report, pruning old checkpoints) is reported too.
3. data wait: the share of step time spent waiting for batches (`perf/data_wait_fraction`,
   logged per step, first 3 steps left out) in the same runs, data in the bucket against data
   on disk. Goal < 1%.

    .venv/bin/python benchmarks/bucket_storage.py            # all three, about 10 minutes
    .venv/bin/python benchmarks/bucket_storage.py --only checkpoint --big-rounds 3
    .venv/bin/python benchmarks/bucket_storage.py --only training --train-rounds 3 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bucket_server import Bucket  # noqa: E402


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f}/{five:.1f}/{fifteen:.1f}"


def _med(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------- 1. checkpoints


def _model_and_optimizer(shape: dict[str, int]):
    import torch

    from raytrain_lm import devices
    from raytrain_lm.config import ModelConfig
    from raytrain_lm.models import build_model

    cfg = ModelConfig(**shape)
    model = build_model(cfg, 257)  # the demo's byte tokenizer
    optimizer = devices.build_adamw(
        model.optimizer_groups(0.1), 1e-3, (0.9, 0.99), torch.device("cpu")
    )
    return cfg, model, optimizer


def checkpoints(bucket: Bucket, work: Path, name: str, shape: dict[str, int], rounds: int):
    """Save (local write + upload into the run directory) and restore, disk vs bucket."""
    import torch

    from raytrain_lm.checkpoints import (
        TrainState,
        restore_newest,
        save_checkpoint,
        upload_checkpoint,
    )
    from raytrain_lm.config import RunConfig, to_yaml
    from raytrain_lm.rundir import CONFIG_FILE, TOKENIZER_FILE, RunDir
    from raytrain_lm.storage import filesystem
    from raytrain_lm.tokenization import ByteTokenizer

    torch.manual_seed(0)
    cfg, model, optimizer = _model_and_optimizer(shape)
    params = model.num_params(non_embedding=False)
    x = torch.randint(0, 257, (1, 16))
    model(x, x)[1].backward()
    optimizer.step()  # AdamW's moments exist: the checkpoint has its real size
    _, target, target_optimizer = _model_and_optimizer(shape)
    texts = {
        TOKENIZER_FILE: ByteTokenizer().to_json(),
        CONFIG_FILE: to_yaml(RunConfig(model=cfg)),
    }
    roots = {"disk": str(work / "checkpoint-runs"), "bucket": f"{bucket.new('ckpt')}/runs"}
    for root in roots.values():  # a worker has written to its run directory before it
        warm = RunDir.of(root, "warm-up")  # uploads a checkpoint: not timed
        warm.write_text("{}", "heartbeat.json")
        warm.delete("heartbeat.json")
    rows: dict[str, list[dict[str, float]]] = {"disk": [], "bucket": []}
    size = 0
    for r in range(rounds):
        for arm in ("disk", "bucket") if r % 2 == 0 else ("bucket", "disk"):
            run_dir = RunDir.of(roots[arm], f"{name}-{r}")
            local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-"))
            cpu = bucket.cpu_seconds()
            t0 = time.perf_counter()
            save_checkpoint(local, model, optimizer, TrainState(step=r + 1), texts)
            t1 = time.perf_counter()
            upload_checkpoint(local, run_dir.at(f"checkpoint_{r:06d}"), retry_for_s=600)
            t2 = time.perf_counter()
            size = sum(p.stat().st_size for p in local.iterdir())
            shutil.rmtree(local)  # as Ray does once the upload is done
            cpu_upload = bucket.cpu_seconds() - cpu
            since = time.time()
            t3 = time.perf_counter()
            found = restore_newest(
                run_dir.checkpoint_folders(), target, target_optimizer, torch.device("cpu")
            )
            t4 = time.perf_counter()
            assert found is not None and found[1].step == r + 1, found
            gets = sum(1 for _, _, method, _ in bucket.requests(since) if method == "GET")
            rows[arm].append(
                {
                    "write": t1 - t0,
                    "upload": t2 - t1,
                    "save": t2 - t0,
                    "restore": t4 - t3,
                    "server_cpu_upload": cpu_upload,
                    "gets": gets,
                }
            )
            fs, inner = filesystem(run_dir.location)
            fs.delete_dir(inner)
            row = rows[arm][-1]
            print(
                f"checkpoint {name} round {r} {arm}: write {row['write']:.2f} s + upload "
                f"{row['upload']:.2f} s = save {row['save']:.2f} s, restore "
                f"{row['restore']:.2f} s (server CPU during upload {cpu_upload:.1f} s, "
                f"{gets} GETs while restoring); load {_load()}",
                flush=True,
            )

    def summary(key: str) -> dict[str, float]:
        disk = [row[key] for row in rows["disk"]]
        bucket_ = [row[key] for row in rows["bucket"]]
        ratios = [b / d for b, d in zip(bucket_, disk, strict=True)]
        return {
            "disk_s": round(_med(disk), 3),
            "bucket_s": round(_med(bucket_), 3),
            "ratio_median": round(_med(ratios), 2),
            "ratios": [round(x, 2) for x in ratios],
        }

    return {
        "params": params,
        "checkpoint_mb": round(size / 1e6, 1),
        "write": summary("write"),
        "upload": summary("upload"),
        "save": summary("save"),
        "restore": summary("restore"),
        "server_cpu_s_per_upload": round(_med(r["server_cpu_upload"] for r in rows["bucket"]), 1),
        "gets_per_restore": _med(r["gets"] for r in rows["bucket"]),
    }


# ---------------------------------------------------------------------------- 2./3. training


def _run(work: Path, name: str, output_dir: str, cache_dir: str, args, every: int) -> dict:
    import raytrain_lm
    from raytrain_lm.config import load_config

    overrides = [
        f"name={name}",
        f"output_dir={output_dir}",
        f"data.cache_dir={cache_dir}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        *(f"model.{k}={v}" for k, v in args.train_model.items()),
        f"training.max_steps={args.steps}",
        f"training.eval_every={args.steps}",
        "training.eval_sequences=16",
        "training.sample_tokens=0",
        "training.progress=false",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=2",
        "scaling.num_workers=1",
        "scaling.cpus_per_worker=2",
        "fault.health_check_s=0.5",
    ]
    return raytrain_lm.train(load_config(None, overrides), sample=False)


def _steps(work: Path, run_id: str) -> list[dict[str, float]]:
    """Per step: its end (wall clock), duration and data wait, from MLflow."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    times = {m.step: m for m in client.get_metric_history(run_id, "perf/step_time_s")}
    waits = {m.step: m.value for m in client.get_metric_history(run_id, "perf/data_wait_fraction")}
    return [
        {
            "step": step,
            "end": times[step].timestamp / 1000,
            "seconds": times[step].value,
            "wait": waits[step],
        }
        for step in sorted(times)
    ]


def _upload_windows(bucket: Bucket, run: str, since: float) -> list[tuple[float, float]]:
    """(first request, end of the COMPLETE marker's PUT) of each checkpoint uploaded into
    `run` (a bucket URI), from the server's request log."""
    prefix = "/" + run.removeprefix("s3://") + "/"
    folders: dict[str, list[float]] = {}
    for start, end, method, path in bucket.requests(since):
        if method in ("PUT", "POST") and path.startswith(prefix + "checkpoint_"):
            folder, _, file = path[len(prefix) :].partition("?")[0].partition("/")
            span = folders.setdefault(folder, [start, float("nan")])
            span[0] = min(span[0], start)
            if file == "COMPLETE":
                span[1] = end
    return sorted((a, b) for a, b in folders.values() if b == b)


def _pause_requests(bucket: Bucket, run: str, since: float, pauses) -> float:
    """Median number of requests to the bucket holding `run` that start during a checkpoint
    pause, besides the upload's own and the heartbeat thread's: what the training thread asks
    of the bucket per checkpoint (listing, markers and states of the checkpoints, deletes)."""
    bucket_path = "/" + run.removeprefix("s3://").split("/")[0]
    checkpoints = "/" + run.removeprefix("s3://") + "/checkpoint_"
    mine = [
        start
        for start, _, method, path in bucket.requests(since)
        if path.startswith(bucket_path)
        and not (method in ("PUT", "POST") and path.startswith(checkpoints))
        and not path.endswith("/heartbeat.json")
    ]
    return _med(sum(1 for start in mine if a <= start <= b) for a, b in pauses)


def _measure_run(steps: list[dict], every: int, windows) -> dict:
    """Step times (all, overlapping an upload, not), the pause each checkpoint makes on the
    training thread, data wait."""
    for s in steps:
        s["begin"] = s["end"] - s["seconds"]
        s["uploading"] = any(a < s["end"] and s["begin"] < b for a, b in windows)
    by_step = {s["step"]: s for s in steps}
    checkpointed = [c for c in by_step if c % every == 0 and c + 1 in by_step]
    # From the checkpoint step's metrics to the next step's start: writing the checkpoint
    # locally, reporting it to Ray Train, pruning old ones (the upload itself is not in it).
    pauses = [(by_step[c]["end"], by_step[c + 1]["begin"]) for c in checkpointed]
    after = {c + 1 for c in checkpointed}
    waits = sorted(s["wait"] for s in steps)
    return {
        "step_s": _med(s["seconds"] for s in steps),
        "step_s_uploading": _med(s["seconds"] for s in steps if s["uploading"]),
        "step_s_not_uploading": _med(s["seconds"] for s in steps if not s["uploading"]),
        # the first step after a checkpoint, and the others: a control for `uploading`
        "step_s_after_checkpoint": _med(s["seconds"] for s in steps if s["step"] in after),
        "step_s_other": _med(s["seconds"] for s in steps if s["step"] not in after),
        "pauses": pauses,
        "steps_uploading": sum(s["uploading"] for s in steps),
        "uploads": len(windows),
        "upload_s": _med(b - a for a, b in windows),
        "checkpoint_pause_s": _med(b - a for a, b in pauses),
        "wait_mean": statistics.fmean(waits),
        "wait_p99": waits[int(0.99 * (len(waits) - 1))],
        "steps": len(steps),
    }


def training(bucket: Bucket, work: Path, args) -> dict:
    from raytrain_lm.config import load_config
    from raytrain_lm.data.prepare import prepare

    data_bucket = bucket.new("data")
    runs_bucket = bucket.new("runs")
    arms = {
        # name: (output_dir, data.cache_dir, checkpoint.every_steps)
        "disk+ckpt": (str(work / "runs"), str(work / "data"), args.every),
        "bucket": (f"{runs_bucket}/runs", f"{data_bucket}/data", args.steps),
        "bucket+ckpt": (f"{runs_bucket}/runs", f"{data_bucket}/data", args.every),
    }
    for cache_dir in (str(work / "data"), f"{data_bucket}/data"):  # prepared once, not timed
        prepare(load_config(None, [f"data.cache_dir={cache_dir}"]).data, progress=False)
    names = list(arms)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.train_rounds):
        for arm in names[r % 3 :] + names[: r % 3]:
            output_dir, cache_dir, every = arms[arm]
            name = f"{arm.replace('+', '-')}-{r}-{int(time.time())}"
            since, cpu = time.time(), bucket.cpu_seconds()
            summary = _run(work, name, output_dir, cache_dir, args, every)
            steps = [s for s in _steps(work, summary["mlflow_run_id"]) if s["step"] > 3]
            windows = []
            if output_dir.startswith("s3://"):
                windows = _upload_windows(bucket, f"{output_dir}/{name}", since)
                windows = [w for w in windows if w[0] < steps[-1]["end"]]  # not the last one
            result = _measure_run(steps, every, windows)
            pauses = result.pop("pauses")
            if output_dir.startswith("s3://") and pauses:
                result["requests_per_pause"] = _pause_requests(
                    bucket, f"{output_dir}/{name}", since, pauses
                )
            result["server_cpu_s"] = bucket.cpu_seconds() - cpu
            result["wall_s"] = summary["wall_s"]
            results[arm].append(result)
            print(
                f"train round {r} {arm}: median step {result['step_s'] * 1000:.0f} ms "
                f"(overlapping an upload {result['step_s_uploading'] * 1000:.0f} ms, "
                f"{result['steps_uploading']} steps, {result['uploads']} uploads of median "
                f"{result['upload_s']:.2f} s; other steps "
                f"{result['step_s_not_uploading'] * 1000:.0f} ms; first step after a checkpoint "
                f"{result['step_s_after_checkpoint'] * 1000:.0f} ms, others "
                f"{result['step_s_other'] * 1000:.0f} ms), pause per checkpoint "
                f"{result['checkpoint_pause_s']:.2f} s "
                f"({result.get('requests_per_pause', 0):.0f} requests), "
                f"data wait mean {result['wait_mean']:.2%} "
                f"p99 {result['wait_p99']:.2%}, server CPU {result['server_cpu_s']:.1f} s, "
                f"wall {result['wall_s']:.0f} s; load {_load()}",
                flush=True,
            )

    def ratios(pairs) -> dict:
        values = [a / b for a, b in pairs]
        return {"ratio_median": round(_med(values), 3), "ratios": [round(x, 3) for x in values]}

    disk, plain, ckpt = results["disk+ckpt"], results["bucket"], results["bucket+ckpt"]
    pairs = list(zip(ckpt, plain, strict=True))
    return {
        "runs": results,
        "step_uploading_vs_no_checkpoints": ratios(
            (c["step_s_uploading"], p["step_s"]) for c, p in pairs
        ),
        "step_uploading_vs_other_steps_same_run": ratios(
            (c["step_s_uploading"], c["step_s_not_uploading"]) for c in ckpt
        ),
        "run_median_step_vs_no_checkpoints": ratios((c["step_s"], p["step_s"]) for c, p in pairs),
        "step_after_checkpoint_vs_others": {
            arm: ratios((x["step_s_after_checkpoint"], x["step_s_other"]) for x in results[arm])
            for arm in ("bucket+ckpt", "disk+ckpt")
        },
        "checkpoint_pause_bucket_vs_disk": ratios(
            (c["checkpoint_pause_s"], d["checkpoint_pause_s"])
            for c, d in zip(ckpt, disk, strict=True)
        ),
        "step_bucket_vs_disk": ratios(
            (c["step_s"], d["step_s"]) for c, d in zip(ckpt, disk, strict=True)
        ),
        "data_wait": {
            arm: {
                "mean": [round(x["wait_mean"], 5) for x in results[arm]],
                "p99": [round(x["wait_p99"], 5) for x in results[arm]],
            }
            for arm in names
        },
    }


# ---------------------------------------------------------------------------- main


def _shape(text: str) -> dict[str, int]:
    """`n_layer=14,n_head=12,n_embd=768,block_size=1024` -> a dict of model settings."""
    return {k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["checkpoint", "training"], default=None)
    parser.add_argument("--rounds", type=int, default=3, help="checkpoint rounds, demo model")
    parser.add_argument("--big-rounds", type=int, default=2, help="checkpoint rounds, big model")
    parser.add_argument(
        "--big-model",
        type=_shape,
        default=_shape("n_layer=14,n_head=12,n_embd=768,block_size=1024"),
        help="~100M parameters with the byte vocabulary",
    )
    parser.add_argument("--train-rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120, help="steps per training run")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--train-model", type=_shape, default=_shape(""), help="as --big-model")
    parser.add_argument("--moto-as-is", action="store_true", help="whole-object ranged GETs")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="raytrain-bucket-bench-"))
    bucket = Bucket(work, args.moto_as_is)
    result: dict = {"load_at_start": _load()}
    started = time.time()
    try:
        if args.only in (None, "checkpoint"):
            demo = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
            result["checkpoint_demo"] = checkpoints(bucket, work, "demo", demo, args.rounds)
            print("checkpoint demo: " + json.dumps(result["checkpoint_demo"]), flush=True)
            if args.big_rounds:
                big = checkpoints(bucket, work, "big", args.big_model, args.big_rounds)
                result["checkpoint_big"] = big
                print("checkpoint big: " + json.dumps(big), flush=True)
        if args.only in (None, "training"):
            import ray

            from raytrain_lm.trainer.driver.launch import default_ray_env

            default_ray_env()
            # A Ray of its own, started after the bucket's variables are set: workers inherit
            # them. Sized as ddp_overhead.py's: 1 worker x 2 CPUs plus Ray Data's CPU.
            for attempt in range(3):  # a saturated machine can exceed the raylet's 30 s
                try:
                    ray.init(address="local", num_cpus=4, log_to_driver=False)
                    break
                except Exception:
                    ray.shutdown()
                    if attempt == 2:
                        raise
            result["training"] = training(bucket, work, args)
            print("training: " + json.dumps(result["training"]), flush=True)
    finally:
        bucket.close()
        shutil.rmtree(work, ignore_errors=True)
    result["load_at_end"] = _load()
    result["wall_s"] = round(time.time() - started)
    print("bucket: " + json.dumps(result))


if __name__ == "__main__":
    main()
