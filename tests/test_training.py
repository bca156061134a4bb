"""End-to-end Ray Train runs on a tiny model (gloo on CPU), sharing one Ray session."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import BATCH, STEPS
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

import raytrain_lm
from raytrain_lm.clusters.multinode import segments
from raytrain_lm.config import load_config
from raytrain_lm.errors import find_user_error
from raytrain_lm.run_events.journal import read_events


def _run(overrides: list[str]) -> dict:
    return raytrain_lm.train(load_config(None, overrides), sample=False)


def _history(summary: dict, uri: str, key: str = "train/loss") -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    return sorted(
        (m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], key)
    )


def _uri(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri="))


def _output_dir(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))


def test_two_worker_run_learns_and_is_tracked(learned_run):
    summary, overrides = learned_run["summary"], learned_run["overrides"]
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 8 * 32
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0 and not summary["stopped"]
    run_dir = learned_run["output_dir"] / "learns"
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    uri = _uri(overrides)
    val = _history(summary, uri, "val/loss")
    assert [s for s, _ in val] == [20, 40]
    assert val[0][1] < 4.5 and val[1][1] < val[0][1] - 0.1, val  # ln(257) = 5.55 at the start
    train = _history(summary, uri)
    assert [s for s, _ in train] == list(range(1, 41))  # every step, not only log points
    grad_norms = _history(summary, uri, "train/grad_norm")
    assert [s for s, _ in grad_norms] == list(range(1, 41)) and all(g > 0 for _, g in grad_norms)

    # No step waits for the device: its loss and grad norm are read, all at once, only where
    # something needs them: the first step, the end of warm-up (3), logging (every 10),
    # evaluation and checkpoints (20, 40).
    (syncs,) = [e for e in read_events(run_dir) if e["event"] == "host_syncs"]
    assert syncs["per_step"] == {str(step): 0 for step in range(1, 41)}, syncs
    assert sorted(int(s) for s in syncs["at_reads"]) == [1, 3, 10, 20, 30, 40], syncs
    assert all(count >= 1 for count in syncs["at_reads"].values()), syncs

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "learns"
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["model.n_layer"] == "2"
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "world_size"):
        assert key in run.data.metrics, key
    assert 0 < run.data.metrics["perf/mfu"] <= 1.0
    assert run.data.metrics["world_size"] == 2
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "tokenizer.json", "summary.json", "final"} <= artifacts
    final = {a.path for a in client.list_artifacts(run.info.run_id, "final")}
    assert {"final/model.safetensors", "final/tokenizer.json"} <= final
    # a llama with 1 key/value head for its 2 query heads and an untied output projection:
    # both embedding matrices are kept
    from raytrain_lm.checkpoints import latest_complete_checkpoint

    weights = load_file(str(Path(latest_complete_checkpoint(run_dir)) / "model.safetensors"))
    assert {"embed_tokens.weight", "lm_head.weight", "layers.1.mlp.gate_proj.weight"} <= set(
        weights
    )
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 1 head of 16
    assert run.data.params["model.arch"] == "llama"
    # Sharded: each rank wrote its own shards; only the last checkpoint gathered the whole
    # weights, and those are what MLflow holds.
    from raytrain_lm.checkpoints import complete_checkpoints, read_state

    middle, last = (Path(c) for c in complete_checkpoints(run_dir))
    assert read_state(middle).strategy == read_state(last).strategy == "fsdp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in middle.iterdir()}
    assert not (middle / "model.safetensors").exists()

    # Starting the same run again resumes it: nothing left to do, same MLflow run, and the
    # summary gives the figures of the run as it finished.
    again = _run(overrides)
    assert again["steps"] == 40 and again["mlflow_run_id"] == summary["mlflow_run_id"]
    for key in ("train_loss", "val_loss", "tokens_per_s", "checkpoint"):
        assert again[key] == summary[key] and again[key] is not None, key
    # Its data, an MLflow dataset input (logged once, whatever the restarts): the manifest's
    # digest and the folder lead back to the exact shards.
    (data,) = client.get_run(summary["mlflow_run_id"]).inputs.dataset_inputs
    source = json.loads(data.dataset.source)["uri"]
    manifest = (Path(source) / "manifest.json").read_bytes()
    assert data.dataset.digest == hashlib.sha256(manifest).hexdigest()[:32]
    assert data.dataset.name == f"raytrain-lm-{Path(source).name}"
    assert [t.value for t in data.tags if t.key == "mlflow.data.context"] == ["training"]
    profile = json.loads(data.dataset.profile)
    assert profile["sources"] == ["builtin:python-docs"] and profile["curation"] is None
    assert profile["tokens"]["train"] == json.loads(manifest)["splits"]["train"]["tokens"]

    from raytrain_lm.generate import resolve_checkpoint, sample

    text = sample(resolve_checkpoint("learns", str(learned_run["output_dir"])), "The ", 30)
    assert text.startswith("The ") and len(text) > 4


def test_a_run_that_cannot_resume_faithfully_is_refused(learned_run, tmp_path):
    """On a copy of a finished run: a changed model is refused; checkpoints whose weights
    were altered in place (sizes unchanged) make the worker refuse to start from step 0, in
    one line; weights cut short leave no complete checkpoint, refused before anything
    starts."""
    import shutil

    from raytrain_lm.checkpoints import complete_checkpoints
    from raytrain_lm.errors import UserError

    run_dir = tmp_path / "runs" / "refuse"
    shutil.copytree(learned_run["output_dir"] / "learns", run_dir)
    (run_dir / "tracking.json").unlink()  # its own MLflow run, not the original's
    overrides = [
        *(o for o in learned_run["overrides"] if not o.startswith(("output_dir=", "name="))),
        f"output_dir={tmp_path / 'runs'}",
        "name=refuse",
        "training.max_steps=44",
        "fault.max_failures=0",
    ]
    with pytest.raises(UserError, match="exists with model.n_layer=2, now 3"):
        _run([*overrides, "model.n_layer=3"])
    with pytest.raises(UserError, match="checkpointed with parallel.strategy=fsdp, now ddp"):
        _run([*overrides, "parallel.strategy=ddp"])

    checkpoints = complete_checkpoints(run_dir)
    assert len(checkpoints) == 2
    for checkpoint in checkpoints:  # rank 1's shards (the run is sharded)
        weights = Path(checkpoint) / "__1_0.distcp"
        weights.write_bytes(bytes(b ^ 0xFF for b in weights.read_bytes()))
    with pytest.raises(Exception) as raised:
        _run(overrides)
    assert "none can be restored; refusing to start from step 0" in str(
        find_user_error(raised.value)
    )
    for checkpoint in checkpoints:
        with open(Path(checkpoint) / "__1_0.distcp", "r+b") as f:
            f.truncate(100)
    with pytest.raises(UserError, match="none is complete; refusing to start from step 0"):
        _run(overrides)


def test_resume_is_bit_for_bit(ray_session, tiny_overrides, tmp_path, monkeypatch):
    """Stopped on request a few steps in (SIGTERM to the driver, what `raytrain-lm stop` and
    `ray job stop` send), far from a periodic checkpoint: the workers checkpoint at the next
    step and the run ends, saying so. Resumed; on the way rank 0 is SIGKILLed half-way
    through writing the step-8 checkpoint, and a planted partial checkpoint (marker present,
    model file cut short) sits newest on disk. The run restarts from the newest complete
    checkpoint before step 8, never loads a partial one, and ends bit-identical to an
    uninterrupted run: same weights, same losses at every step, every sequence once, one
    MLflow run."""
    import os
    import signal
    import threading
    import time

    from raytrain_lm.checkpoints import complete_checkpoints
    from raytrain_lm.data.ledger import read_ledger
    from raytrain_lm.run_events.journal import Heartbeat, read_events
    from raytrain_lm.trainer import chaos

    common = [
        *tiny_overrides,
        "model.dropout=0.1",
        "training.max_steps=12",
        "training.eval_every=4",
        "checkpoint.every_steps=4",
        "training.ledger=true",
    ]
    straight = _run([*common, "name=straight"])
    run_dir = tmp_path / "runs" / "resumed"

    def stop_after_two_steps() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            beat = Heartbeat.read(run_dir)
            if beat is not None and beat.step >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    # Paced so that the stop, asked for at step 2, lands before step 8 on a loaded machine too.
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.6")
    threading.Thread(target=stop_after_two_steps, daemon=True).start()
    first = _run([*common, "name=resumed", "fault.preemption_check_s=0.3"])
    assert first["stopped"] and 2 <= first["steps"] < 8, first
    (stop,) = [e for e in read_events(run_dir) if e["event"] == "stop"]
    assert stop["step"] == first["steps"]  # the checkpoint is the stop's own step
    assert not (run_dir / "STOP").exists()
    stopped_at = first["steps"]

    partial = run_dir / "checkpoint_9999-12-31_23-59-59.000000"
    partial.mkdir()
    for item in Path(complete_checkpoints(run_dir)[-1]).iterdir():
        (partial / item.name).write_bytes(item.read_bytes())
    (partial / "train_state.json").write_text('{"step": 11, "tokens": 0, "position": 88}')
    with open(partial / "model.safetensors", "r+b") as model_file:
        model_file.truncate(100)

    monkeypatch.setenv(chaos.ENV_VAR, "kill-in-checkpoint:step=8:rank=0")
    resumed = _run([*common, "name=resumed"])
    assert (run_dir / "fault-fired-kill-in-checkpoint-8-0").exists()
    assert resumed["steps"] == 12 and resumed["mlflow_run_id"] == first["mlflow_run_id"]
    assert not resumed["stopped"]
    assert resumed["goodput"]["restarts"] >= 2  # the resume, and the restart after the kill
    restored = [e["restored_step"] for e in read_events(run_dir) if e["event"] == "segment_start"]
    # Nothing lost to the stop; after the kill, the newest complete checkpoint: the stop's, or
    # step 4's where the stop came before it.
    assert restored == [0, stopped_at, max(stopped_at, 4)], restored

    uri = _uri(common)
    # the steps after the stop, trained again after the kill, logged the same values twice
    assert sorted(set(_history(resumed, uri))) == _history(straight, uri)
    a = load_file(str(Path(straight["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(resumed["checkpoint"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    consumed = read_ledger(run_dir)
    assert consumed.tolist() == list(range(12 * 8))  # every position once, none repeated
    assert consumed.tolist() == read_ledger(tmp_path / "runs" / "straight").tolist()


def test_sharded_restarts_at_other_world_sizes_match_an_uninterrupted_run(world_size_runs):
    """Sharded, stopped (training.stop_after_step) and restarted from its DCP checkpoints with
    another layout each time: hsdp 2x2 (2 shard groups of 2) -> hsdp 1x2 -> hsdp 2x2 -> fsdp
    over 4: a replica lost, one added back, then every worker one shard group, each start
    loading shards written by another mesh. The trained sequence positions are the
    uninterrupted 2-worker DDP run's, each exactly once; the world size is logged at each
    (re)start; and every step's loss (steps 1-3 on 4 workers x 3 accumulation steps, 4-6 on
    2 x 6, 7-12 on 4 x 3) and the val loss are the uninterrupted run's in fp32. The restarts
    also turn activation checkpointing on (full, then selective): it changes no loss, and
    checkpoints load across the settings. With the equivalence of 1 worker, DDP, FSDP and
    HSDP (test_parallel.py, test_hybrid.py), this is the world-size invariance of the loop
    and its data."""
    from raytrain_lm.data.ledger import read_ledger

    common, straight = world_size_runs["common"], world_size_runs["reference"]
    runs = world_size_runs["output_dir"]
    assert read_ledger(runs / "uninterrupted").tolist() == list(range(STEPS * BATCH))
    sizes, stops = (4, 2, 4, 4), (3, 6, 9, None)
    recomputation = ("none", "full", "selective", "none")  # a memory setting a restart may change
    hsdp = ["parallel.strategy=hsdp", "parallel.shard_size=2"]  # one Ray node: groups of 2
    layouts = (hsdp, hsdp, hsdp, ["parallel.strategy=fsdp"])
    for workers, stop, recompute, layout in zip(sizes, stops, recomputation, layouts, strict=True):
        extra = [f"training.stop_after_step={stop}"] if stop else []
        extra += [f"training.activation_checkpointing={recompute}", *layout]
        summary = _run([*common, "name=resized", f"scaling.num_workers={workers}", *extra])
        assert summary["steps"] == (stop or STEPS)
    assert summary["tokens"] == straight["tokens"] == STEPS * BATCH * 32
    assert read_ledger(runs / "resized").tolist() == list(range(STEPS * BATCH))
    client = MlflowClient(tracking_uri=_uri(common))
    logged = client.get_metric_history(summary["mlflow_run_id"], "world_size")
    assert sorted((m.step, m.value) for m in logged) == [(0, 4), (3, 2), (6, 4), (9, 4)]
    expected = _history(straight, _uri(common))
    got = _history(summary, _uri(common))
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    gaps = [abs(value - ref) for (_, ref), (_, value) in zip(expected, got, strict=True)]
    assert max(gaps) < 1e-4, gaps
    assert summary["val_loss"] == pytest.approx(straight["val_loss"], abs=1e-3)
    assert summary["goodput"]["restarts"] == 3
    assert [s["layout"] for s in segments(runs / "resized")] == [
        "hsdp: mesh 2 (replicate) x 2 (shard)",
        "hsdp: mesh 1 (replicate) x 2 (shard)",
        "hsdp: mesh 2 (replicate) x 2 (shard)",
        "fsdp: mesh 4 (shard)",
    ]
