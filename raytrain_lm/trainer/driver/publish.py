"""What a run leaves when it ends: its summary (`summary.json`), and in MLflow the final
weights, tokenizer, summary and goodput figures, with the MLflow run ended.

A run started again after it had trained to its end (a no-op resume) changes none of it:
`finished_summary` gives the summary as the run finished, and the driver returns it without
opening MLflow. `wall_s` is the driver's wall time over every invocation that trained the run
(a resumed run adds its time to the summary it resumed from), never a no-op's seconds.
"""

from __future__ import annotations

import json
import time
from typing import Any

from raytrain_lm.checkpoints import (
    MODEL_FILE,
    TrainState,
    latest_complete_checkpoint,
    read_state,
)
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import close_previous_segment, read_events
from raytrain_lm.rundir import SUMMARY_FILE, TOKENIZER_FILE, RunDir
from raytrain_lm.storage import Location
from raytrain_lm.trainer.spec import WorkerSpec


def read_summary(run_dir: RunDir) -> dict[str, Any] | None:
    text = run_dir.read_text(SUMMARY_FILE)
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return None


def finished_summary(run_dir: RunDir, final: Location) -> dict[str, Any] | None:
    """The run's summary if it describes its checkpoint `final` as trained to the end (not a
    stop's), with `checkpoint` naming where `final` is now (a run directory may be copied or
    moved); None if the run still has to be published."""
    summary = read_summary(run_dir)
    if summary is None or summary.get("stopped") or not summary.get("checkpoint"):
        return None
    if Location(summary["checkpoint"]).name != final.name:
        return None
    if summary.get("steps") != read_state(final).step:
        return None
    return summary | {"checkpoint": str(final)}


def publish(
    spec: WorkerSpec,
    tracker,
    started: float,
    stopped: bool | str,
    trained: bool,
    earlier: dict[str, Any] | None,
) -> dict[str, Any]:
    """The summary of the run as its newest checkpoint left it; with tracking, the final
    weights, tokenizer and summary as artifacts, and the MLflow run ended. `trained`: this
    invocation trained (its time counts); `earlier`: the summary the run resumed from."""
    cfg, run_dir = spec.config, spec.run_dir
    final = latest_complete_checkpoint(run_dir)
    if final is None:
        raise RuntimeError(f"training ended without a complete checkpoint in {run_dir}")
    state: TrainState = read_state(final)
    close_previous_segment(run_dir)
    tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
    events = read_events(run_dir)
    goodput = summarize(events).metrics(state.tokens, tokens_per_step)
    if earlier is not None or trained:
        wall_s = (earlier or {}).get("wall_s", 0.0) + (time.time() - started if trained else 0)
    else:  # trained to the end by a driver that died before publishing: its groups' time
        wall_s = summarize(events).wall_s
    summary = {
        "run": cfg.name,
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": state.train_loss,
        "val_loss": state.val_loss,
        "tokens_per_s": state.tokens_per_s,
        "shares": state.shares,
        "per_type": {
            kind: {k: round(v, 4) for k, v in figures.items()}
            for kind, figures in state.per_type.items()
        },
        "wall_s": round(wall_s, 1),
        "mlflow_run_id": tracker.run_id if tracker else None,
        "checkpoint": str(final),
        "stopped": stopped,
        "goodput": {
            k.removeprefix("goodput/").replace("/", "_"): round(v, 4) for k, v in goodput.items()
        },
    }
    run_dir.write_text(json.dumps(summary, indent=2), SUMMARY_FILE)
    if stopped:
        why = "spent budget.max_usd" if stopped == "budget" else "stopped"
        again = "with a larger budget.max_usd" if stopped == "budget" else "again"
        print(
            f"[raytrain-lm] run '{cfg.name}' {why} at step {state.step} with a checkpoint; "
            f"run the same command {again} to resume",
            flush=True,
        )
    if tracker is not None:
        tracker.log_metrics(goodput, step=state.step)
        with RunDir(final).local_files(MODEL_FILE, TOKENIZER_FILE) as (weights, tokenizer):
            if not stopped:
                tracker.log_artifact(weights, "final")
                tracker.log_artifact(tokenizer, "final")
            with run_dir.local_files(SUMMARY_FILE) as (summary_file,):
                tracker.log_artifact(summary_file)
                # Deferred uploads (the store was away) read these files until then.
                tracker.finish("KILLED" if stopped else "FINISHED")
    return summary
