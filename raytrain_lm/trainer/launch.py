"""The driver side of a training run: prepare data, open tracking, run the TorchTrainer,
then publish the summary, final weights and a sample."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain_lm.config import RunConfig, flatten, to_yaml
from raytrain_lm.data.manifest import verify_shards
from raytrain_lm.data.prepare import prepare
from raytrain_lm.data.storage import is_uri
from raytrain_lm.errors import UserError
from raytrain_lm.placement import keep_gpu_nodes_releasable, worker_resources
from raytrain_lm.runtime import ensure_ray, use_gpu
from raytrain_lm.tokenization import TOKENIZER_FILE, load_tokenizer
from raytrain_lm.tracking import MLflowTracker, resolve_tracking_uri
from raytrain_lm.trainer import faults
from raytrain_lm.trainer.checkpoint import CONFIG_FILE, latest_complete_checkpoint, read_state
from raytrain_lm.trainer.goodput import append_event, close_previous_segment, read_events, summarize

TRACKING_FILE = "tracking.json"
SUMMARY_FILE = "summary.json"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's, in the run directory
# What defines a run: resuming with any of these changed would silently make a different run.
IDENTITY_SECTIONS = ("model", "data", "optim")
IDENTITY_KEYS = ("training.global_batch_size", "training.seed")


def _check_writable(directory: Path) -> None:
    """Fails early if `directory` could not be created or written, leaving nothing behind."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"output directory {directory} is not writable: {exc.strerror}") from None


def _check_resume_compatible(
    cfg: RunConfig, run_dir: Path, may_change: tuple[str, ...] = ()
) -> None:
    """`may_change`: keys a PBT trial may resume with changed (see sweeps.PBT_MUTABLE)."""
    saved_file = run_dir / CONFIG_FILE
    if not saved_file.is_file():
        return
    saved = flatten(yaml.safe_load(saved_file.read_text()))
    current = flatten(cfg)
    for key, value in current.items():
        if key in may_change:
            continue
        if key.split(".")[0] in IDENTITY_SECTIONS or key in IDENTITY_KEYS:
            old = saved.get(key)
            if old != value:
                raise UserError(
                    f"run '{cfg.name}' exists with {key}={old!r}, now {value!r}; "
                    f"resume with the same settings or choose another name=..."
                )


def check_data_matches_model(cfg: RunConfig, manifest) -> None:
    """Refuses a prepared dataset whose tokenizer or vocabulary the config cannot use."""
    if cfg.data.prepared and manifest.tokenizer_kind != cfg.data.tokenizer.kind:
        raise UserError(
            f"prepared data {cfg.data.prepared} uses a {manifest.tokenizer_kind} tokenizer, "
            f"the config says data.tokenizer.kind={cfg.data.tokenizer.kind}"
        )
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < manifest.vocab_size:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the prepared data's "
            f"vocabulary ({manifest.vocab_size}, {manifest.tokenizer_kind} tokenizer)"
        )
    needed = cfg.model.block_size + 1
    if not any(s.tokens >= needed for s in manifest.splits["train"].shards):
        raise UserError(
            f"training split too small: no shard holds {needed} tokens (model.block_size + 1)"
        )


def _tracking(
    cfg: RunConfig,
    run_dir: Path,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
) -> MLflowTracker | None:
    """The run's MLflow run: the one in run_dir/tracking.json when resuming, else a new one,
    nested under `parent_run_id` (a sweep) when given, tagged with `tags`."""
    if not cfg.tracking.enabled:
        return None
    uri = resolve_tracking_uri(cfg.tracking)
    previous = run_dir / TRACKING_FILE
    run_id = json.loads(previous.read_text())["mlflow_run_id"] if previous.is_file() else None
    tracker = MLflowTracker.start(
        uri,
        cfg.tracking.experiment,
        cfg.name,
        run_id,
        parent_run_id=parent_run_id,
        tags=tags,
        wait_s=cfg.tracking.start_wait_s,
    )
    previous.write_text(json.dumps({"tracking_uri": uri, "mlflow_run_id": tracker.run_id}))
    return tracker


def train(
    cfg: RunConfig,
    *,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
    callbacks: list | None = None,
    may_change: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Runs (or resumes) `cfg` to completion and returns the summary dict.

    A sweep trial passes its sweep's MLflow `parent_run_id`, `tags` for its MLflow run, extra
    Ray Train `callbacks` (its report to Tune) and, under PBT, the keys it `may_change` when it
    resumes (a perturbation).
    """
    started = time.time()
    storage = Path(cfg.output_dir).resolve()
    run_dir = storage / cfg.name
    _check_writable(storage)
    _check_resume_compatible(cfg, run_dir, may_change)

    if not cfg.data.prepared:
        ensure_ray(cfg.scaling)  # prepare runs as a Ray Data job; size Ray for training first
    prepared = prepare(cfg.data)
    manifest = prepared.manifest
    # Refuse corrupted data before starting. Shards the verification stamp vouches for are not
    # hashed again; after a fresh prepare this hashes each once, so workers need not.
    verify_shards(prepared.directory, manifest)
    verb = "prepared" if prepared.created else "using prepared"
    print(
        f"[raytrain-lm] {verb} data {prepared.directory}: {manifest.splits['train'].tokens:,} train "
        f"/ {manifest.splits['val'].tokens:,} val tokens, {manifest.tokenizer_kind} tokenizer "
        f"(vocab {manifest.vocab_size})",
        flush=True,
    )
    check_data_matches_model(cfg, manifest)
    ensure_ray(cfg.scaling)
    keep_gpu_nodes_releasable()

    previous = latest_complete_checkpoint(run_dir)
    if previous is not None:
        state = read_state(previous)
        print(
            f"[raytrain-lm] resuming run '{cfg.name}' from {previous.name}: step {state.step}, "
            f"{state.tokens:,} tokens",
            flush=True,
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    tracker = _tracking(cfg, run_dir, parent_run_id, tags)
    if tracker is not None:
        tracker.log_params(flatten(cfg))
        tracker.log_artifact(run_dir / CONFIG_FILE)
        load_tokenizer(prepared.directory).save(run_dir)
        tracker.log_artifact(run_dir / TOKENIZER_FILE)

    gpu = use_gpu(cfg.scaling)
    payload = {
        "config": cfg.model_dump(mode="json"),
        "data_dir": prepared.directory
        if is_uri(prepared.directory)
        else os.path.abspath(prepared.directory),
        "run_dir": str(run_dir),
        "tracking_uri": tracker.uri if tracker else None,
        "mlflow_run_id": tracker.run_id if tracker else None,
        "expect_checkpoint": previous is not None,
        "read_cpus": cfg.scaling.data_cpus / cfg.scaling.max_size,
        "fault": os.environ.get(faults.ENV_VAR),
    }
    end_step = min(cfg.training.max_steps, cfg.training.stop_after_step or cfg.training.max_steps)
    result_metrics: dict[str, Any] = {}
    if previous is not None and read_state(previous).step >= end_step:
        print(f"[raytrain-lm] run '{cfg.name}' already trained to step {read_state(previous).step}")
    else:
        append_event(run_dir, "job_start", pid=os.getpid())
        handoffs = 0
        while True:
            result_metrics = _fit(cfg, payload, storage, run_dir, gpu, tracker, callbacks)
            reached = latest_complete_checkpoint(run_dir)
            if not result_metrics.get("preempted") or reached is None:
                break
            if read_state(reached).step >= end_step:
                break
            # The worker group ended itself after a just-in-time checkpoint because a node was
            # being drained: start a new one at once; Ray schedules nothing on draining nodes.
            handoffs += 1
            budget = cfg.fault.max_preemptions
            if budget != -1 and handoffs > budget:
                raise RuntimeError(
                    f"run '{cfg.name}' was preempted {handoffs} times, over "
                    f"fault.max_preemptions={budget}; start it again to resume"
                )
            payload["expect_checkpoint"] = True
            print(
                f"[raytrain-lm] restarting after preemption at step {read_state(reached).step}",
                flush=True,
            )

    final = latest_complete_checkpoint(run_dir)
    if final is None:
        raise RuntimeError(f"training finished without a complete checkpoint in {run_dir}")
    state = read_state(final)
    close_previous_segment(run_dir)
    tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
    goodput = summarize(read_events(run_dir)).metrics(state.tokens, tokens_per_step)
    summary = {
        "run": cfg.name,
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": result_metrics.get("train_loss"),
        "val_loss": state.val_loss,
        "tokens_per_s": result_metrics.get("tokens_per_s"),
        "wall_s": round(time.time() - started, 1),
        "mlflow_run_id": tracker.run_id if tracker else None,
        "checkpoint": str(final),
        "goodput": {
            k.removeprefix("goodput/").replace("/", "_"): round(v, 4) for k, v in goodput.items()
        },
    }
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    if tracker is not None:
        tracker.log_metrics(goodput, step=state.step)
        tracker.log_artifact(final / "model.safetensors", "final")
        tracker.log_artifact(final / "tokenizer.json", "final")
        tracker.log_artifact(run_dir / SUMMARY_FILE)
        tracker.finish("FINISHED")
    return summary


def _fit(
    cfg: RunConfig, payload: dict, storage: Path, run_dir: Path, gpu: bool, tracker, callbacks=None
):
    """One TorchTrainer.fit(): Ray Train retries failures within it, within the budgets."""
    from ray.train import CheckpointConfig, FailureConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2.api.config import LoggingConfig

    from raytrain_lm.trainer.callbacks import FailureEvents
    from raytrain_lm.trainer.loop import train_loop_per_worker

    fault = cfg.fault
    # Read by Ray Train's controller, which inherits them from this process.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(fault.worker_start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(fault.health_check_s)
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(fault.preemption_check_s)
    os.environ["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] = str(fault.collective_timeout_s)
    # Ray Train lists the checkpoints reported to it in a snapshot and refuses to start a run
    # whose listed checkpoints are gone, as those we prune are (or a PBT trial's superseded
    # ones). The loop restores the newest complete checkpoint on disk itself (loop._restore),
    # so Ray's list is not needed to resume.
    (run_dir / RAY_TRAIN_SNAPSHOT).unlink(missing_ok=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=payload,
        torch_config=TorchConfig(
            backend="nccl" if gpu else "gloo", timeout_s=int(fault.collective_timeout_s)
        ),
        scaling_config=_scaling(cfg, gpu),
        run_config=RayRunConfig(
            name=cfg.name,
            storage_path=str(storage),
            # We prune (last K plus the best by val loss): Ray's own keeps only top-K by one score.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            failure_config=FailureConfig(
                max_failures=fault.max_failures, max_preemption_failures=fault.max_preemptions
            ),
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[
                FailureEvents(str(run_dir), fault.node_loss_wait_s if cfg.scaling.elastic else 0.0),
                *(callbacks or []),
            ],
        ),
    )
    try:
        result = trainer.fit()
    except BaseException:
        if tracker is not None:
            tracker.finish("FAILED")
        raise
    return dict(result.metrics or {})


def _scaling(cfg: RunConfig, gpu: bool):
    import ray
    from ray.train import ScalingConfig

    scaling = cfg.scaling
    placement = worker_resources(scaling, gpu, ray.cluster_resources())
    return ScalingConfig(
        num_workers=(scaling.min_size, scaling.max_size) if scaling.elastic else scaling.max_size,
        use_gpu=gpu,
        elastic_resize_monitor_interval_s=scaling.resize_check_s,
        **placement,
    )


def default_ray_env() -> None:
    """Quiet, fast defaults for local runs; users can override any of them in the environment."""
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
