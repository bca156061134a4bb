"""End-to-end Ray Train runs on a tiny model (gloo on CPU), sharing one Ray session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

import raytrain_lm
from raytrain_lm.config import load_config


def _run(overrides: list[str]) -> dict:
    return raytrain_lm.train(load_config(None, overrides), sample=False)


def _history(summary: dict, uri: str, key: str = "train/loss") -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    return sorted(
        (m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], key)
    )


def _uri(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri="))


def test_two_worker_run_learns_and_is_tracked(ray_session, tiny_overrides, tmp_path):
    overrides = [
        *tiny_overrides,
        "name=learns",
        "training.max_steps=40",
        "training.eval_every=20",
        "checkpoint.every_steps=20",
        "optim.lr=3e-3",
    ]
    summary = _run(overrides)
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 8 * 32
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    run_dir = tmp_path / "runs" / "learns"
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    uri = _uri(overrides)
    val = _history(summary, uri, "val/loss")
    assert [s for s, _ in val] == [20, 40]
    assert val[0][1] < 4.5 and val[1][1] < val[0][1] - 0.1, val  # ln(257) = 5.55 at the start
    train = _history(summary, uri)
    assert [s for s, _ in train] == list(range(1, 41))  # every step, not only log points

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

    # Starting the same run again resumes it: nothing left to do, same MLflow run.
    again = _run(overrides)
    assert again["steps"] == 40 and again["mlflow_run_id"] == summary["mlflow_run_id"]

    from raytrain_lm.generate import resolve_checkpoint, sample

    text = sample(resolve_checkpoint("learns", str(tmp_path / "runs")), "The ", 30)
    assert text.startswith("The ") and len(text) > 4


def test_ddp_equivalence_across_world_sizes(ray_session, tiny_overrides):
    """1 worker x 4 accumulation steps == 2 x 2 == 4 x 1, in fp32, step for step."""
    curves = {}
    for workers in (1, 2, 4):
        overrides = [
            *tiny_overrides,
            f"name=ddp-eq-{workers}",
            f"scaling.num_workers={workers}",
            "training.micro_batch_size=2",
            "training.max_steps=10",
            "training.eval_every=10",
            "training.precision=fp32",
            "checkpoint.every_steps=10",
        ]
        curves[workers] = _history(_run(overrides), _uri(overrides))
    assert [s for s, _ in curves[1]] == list(range(1, 11))
    for workers in (2, 4):
        for (step, ref), (_, got) in zip(curves[1], curves[workers], strict=True):
            assert got == pytest.approx(ref, abs=1e-5), (workers, step)


def test_resume_is_bit_for_bit(ray_session, tiny_overrides, tmp_path):
    common = [
        *tiny_overrides,
        "model.dropout=0.1",
        "training.max_steps=8",
        "training.eval_every=4",
        "checkpoint.every_steps=4",
        "training.ledger=true",
    ]
    straight = _run([*common, "name=straight"])
    first = _run([*common, "name=resumed", "training.stop_after_step=5"])
    assert first["steps"] == 5
    resumed = _run([*common, "name=resumed"])
    assert resumed["steps"] == 8 and resumed["mlflow_run_id"] == first["mlflow_run_id"]

    uri = _uri(common)
    assert _history(resumed, uri) == _history(straight, uri)
    a = load_file(str(Path(straight["checkpoint"]) / "model.safetensors"))
    b = load_file(str(Path(resumed["checkpoint"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    from raytrain_lm.data.ledger import read_ledger

    consumed = read_ledger(tmp_path / "runs" / "resumed")
    assert consumed.tolist() == list(range(8 * 8))  # every position once, none repeated
    assert consumed.tolist() == read_ledger(tmp_path / "runs" / "straight").tolist()


def test_changed_model_on_resume_is_refused(ray_session, tiny_overrides):
    from raytrain_lm.errors import UserError

    overrides = [
        *tiny_overrides,
        "name=refuse",
        "training.max_steps=2",
        "training.eval_every=2",
        "checkpoint.every_steps=2",
    ]
    _run(overrides)
    with pytest.raises(UserError, match="exists with model.n_layer=2, now 3"):
        _run([*overrides, "model.n_layer=3"])


def test_exactly_once_across_a_2_3_1_resize(ray_session, tiny_overrides, tmp_path):
    """Stop and restart with a different number of workers each time: the multiset of trained
    sequence positions equals an uninterrupted run's, each position exactly once."""
    from raytrain_lm.data.ledger import read_ledger

    common = [
        *tiny_overrides,
        "training.global_batch_size=6",
        "training.max_steps=9",
        "training.eval_every=9",
        "checkpoint.every_steps=3",
        "training.ledger=true",
        "data.shuffle_window_shards=1",
    ]
    straight = _run([*common, "name=uninterrupted", "scaling.num_workers=2"])
    for workers, stop in ((2, 3), (3, 6), (1, None)):
        extra = [f"training.stop_after_step={stop}"] if stop else []
        summary = _run([*common, "name=resized", f"scaling.num_workers={workers}", *extra])
        assert summary["steps"] == (stop or 9)
    assert summary["tokens"] == straight["tokens"] == 9 * 6 * 32
    resized = read_ledger(tmp_path / "runs" / "resized")
    assert resized.tolist() == read_ledger(tmp_path / "runs" / "uninterrupted").tolist()
    assert resized.tolist() == list(range(9 * 6))
    uri = _uri(common)
    client = MlflowClient(tracking_uri=uri)
    sizes = sorted(
        (m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], "world_size")
    )
    assert sizes == [(0, 2.0), (3, 3.0), (6, 1.0)]  # the world size logged at each (re)start


def test_resized_run_matches_an_uninterrupted_one(ray_session, tiny_overrides, tmp_path):
    """f. 4 -> 2 -> 4 workers (stopped and restarted from checkpoints): the same sequences
    once each, and a val loss within noise of the uninterrupted 4-worker run (fp32)."""
    from raytrain_lm.data.ledger import read_ledger

    common = [
        *tiny_overrides,
        "training.max_steps=24",
        "training.eval_every=24",
        "checkpoint.every_steps=8",
        "training.ledger=true",
        "training.precision=fp32",
        "optim.lr=3e-3",
    ]
    straight = _run([*common, "name=four", "scaling.num_workers=4"])
    for workers, stop in ((4, 8), (2, 16), (4, None)):
        extra = [f"training.stop_after_step={stop}"] if stop else []
        resized = _run([*common, "name=four-two-four", f"scaling.num_workers={workers}", *extra])
    assert resized["steps"] == 24 and resized["tokens"] == straight["tokens"]
    consumed = read_ledger(tmp_path / "runs" / "four-two-four")
    assert consumed.tolist() == list(range(24 * 8))
    assert resized["val_loss"] == pytest.approx(straight["val_loss"], abs=1e-3)
    assert resized["goodput"]["restarts"] == 2
