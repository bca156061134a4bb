"""Tensor parallelism under Ray Train: the worker loop's own plumbing (a tensor-parallel group
reads one share of the data, counts its loss once and writes the ledger once), against DDP on
the same data split. The parallel arithmetic itself is tests/test_hybrid.py's."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

import raytrain_lm
from raytrain_lm.clusters.multinode import segments
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer.checkpointing.checkpoint_interval import interval_steps

STEPS, BATCH = 8, 8


def _history(summary: dict, uri: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_metric_history(summary["mlflow_run_id"], "train/loss")
    return sorted((m.step, m.value) for m in metrics)


def test_tensor_parallel_hsdp_run_takes_ddps_steps(
    ray_session, tiny_overrides, shared_dirs, tmp_path
):
    """A llama on 4 workers as hsdp 2 (replicate) x 1 (shard) x 2 (tensor), with selective
    activation checkpointing (applied after tensor parallelism: torchtitan's order), checkpointed
    (DCP) midway, against the same run under DDP on 2 workers (the same 2 data-parallel
    shares): every step's loss within 1e-4 in fp32, the val loss within 1e-3, every sequence
    position once in the ledger. The DDP run also checks checkpoint.every_steps=auto: after
    its first checkpoint it sets the interval from what it measured."""
    uri = f"sqlite:///{shared_dirs['mlflow']}"  # tiny_overrides' store
    common = [
        *tiny_overrides,
        "model.arch=llama",
        "model.n_head=4",
        "model.n_kv_head=2",
        f"training.global_batch_size={BATCH}",
        f"training.max_steps={STEPS}",
        f"training.eval_every={STEPS}",
        "checkpoint.every_steps=4",
        "training.ledger=true",
        "training.precision=fp32",
        "data.shuffle_window_shards=1",
    ]
    # The reference also sets its checkpoint interval itself (checkpoint.every_steps=auto):
    # intervals change no loss, so it is still the reference.
    reference = ["name=tp-reference", "scaling.num_workers=2", "checkpoint.every_steps=auto"]
    ddp = raytrain_lm.train(load_config(None, [*common, *reference]), sample=False)
    events = read_events(tmp_path / "runs" / "tp-reference")
    (chosen,) = [e for e in events if e["event"] == "checkpoint_interval"]
    assert chosen["step"] == 2  # the first checkpoint: a quarter of the run, to measure it
    # a 10 ms save against one interruption a day: none more before the end
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [2, STEPS]
    assert chosen["save_s"] > 0 and chosen["step_s"] > 0 and chosen["recovery_s"] == 300
    assert chosen["rate_per_hour"] == pytest.approx(1 / 24, rel=0.01)  # the prior, no incident
    left = STEPS - 2
    assert chosen["steps"] == interval_steps(
        chosen["save_s"], chosen["step_s"], chosen["rate_per_hour"] / 3600, 300, left
    )
    tensor = [
        "name=tp",
        "scaling.num_workers=4",
        "parallel.strategy=hsdp",
        "parallel.shard_size=1",
        "parallel.tensor_parallel=2",
        "training.activation_checkpointing=selective",  # wraps the blocks tensor parallelism split
    ]
    tp = raytrain_lm.train(load_config(None, [*common, *tensor]), sample=False)
    assert tp["steps"] == STEPS and tp["tokens"] == ddp["tokens"]
    (segment,) = segments(tmp_path / "runs" / "tp")
    assert segment["layout"] == "hsdp: mesh 2 (replicate) x 1 (shard) x 2 (tensor)"
    assert segment["world_size"] == 4
    assert read_ledger(tmp_path / "runs" / "tp").tolist() == list(range(STEPS * BATCH))
    expected, got = _history(ddp, uri), _history(tp, uri)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    gaps = [abs(a - b) for (_, a), (_, b) in zip(expected, got, strict=True)]
    assert max(gaps) < 1e-4, gaps
    assert abs(tp["val_loss"] - ddp["val_loss"]) < 1e-3
