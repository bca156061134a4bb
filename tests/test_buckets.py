"""Run state in a bucket: a real S3-protocol server on 127.0.0.1 (moto in server mode, see
support/s3_server.py), reached the standard way, through `AWS_ENDPOINT_URL` and the AWS
credentials in the environment; never a mock of our own functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import TINY

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.data.ledger import read_ledger
from raytrain_lm.errors import UserError
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir
from raytrain_lm.trainer import chaos

GLOBAL_BATCH = 8


def _bucket_run(bucket: str, tmp_path, name: str, *more: str) -> list[str]:
    return [
        *TINY,
        f"output_dir={bucket}/runs",
        f"data.cache_dir={bucket}/data",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"name={name}",
        "scaling.num_workers=2",
        "training.ledger=true",
        *more,
    ]


def test_a_run_keeps_all_its_state_in_a_bucket(s3, tmp_path, monkeypatch):
    """prepare -> train -> a worker killed -> resume from the bucket -> finish -> sample and
    metric history read back from the bucket; nothing written to a local run or data folder."""
    bucket = s3.new_bucket()
    monkeypatch.chdir(tmp_path)  # the default local folders would appear here
    steps = 12
    overrides = _bucket_run(
        bucket,
        tmp_path,
        "cloud",
        f"training.max_steps={steps}",
        "training.eval_every=4",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=1",
    )
    monkeypatch.setenv(chaos.ENV_VAR, "kill-after-checkpoint:step=8:rank=0")
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)

    run = f"{bucket}/runs/cloud"
    assert summary["steps"] == steps and summary["checkpoint"].startswith(f"{run}/checkpoint_")
    assert summary["goodput"]["restarts"] == 1  # the killed worker's group was replaced
    segments = [e for e in read_events(run) if e["event"] == "segment_start"]
    assert [s["restored_step"] for s in segments] == [0, 8]  # resumed from the bucket
    assert read_ledger(run).tolist() == list(range(steps * GLOBAL_BATCH))

    keys = s3.keys(bucket)
    assert any(k.startswith("data/") and k.endswith("/manifest.json") for k in keys)
    files = {k.removeprefix("runs/cloud/") for k in keys if k.startswith("runs/cloud/")}
    for name in ("config.yaml", "tokenizer.json", "tracking.json", "summary.json"):
        assert name in files, sorted(files)
    assert any(f.startswith("events/") for f in files) and "heartbeat.json" in files
    assert any(f.startswith("ledger/steps-") for f in files)
    complete = {f.split("/")[0] for f in files if f.endswith("/COMPLETE")}
    # Pruned in the bucket: the newest (the summary's) and the best by val loss are left.
    assert summary["checkpoint"].rsplit("/", 1)[1] in complete and len(complete) <= 2, complete
    assert json.loads(RunDir(run).read_text("summary.json")) == summary
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()

    text = raytrain_lm.sample("cloud", "The ", 10, output_dir=f"{bucket}/runs")
    assert text.startswith("The ") and len(text) > len("The ")
    history = raytrain_lm.metric_history("cloud", output_dir=f"{bucket}/runs")
    assert list(history["train/loss"].dropna().index) == list(range(1, steps + 1))
    generated = subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", "generate", "--run", run, "--tokens", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr[-2000:]


def test_a_bucket_outage_mid_run_is_waited_out(s3, tmp_path, monkeypatch):
    """The bucket goes away for a while mid-run: uploads are retried with backoff, training
    goes on or waits, no partial checkpoint is ever restored, and the run completes."""
    bucket = s3.new_bucket()
    steps = 60
    overrides = _bucket_run(
        bucket,
        tmp_path,
        "outage",
        f"training.max_steps={steps}",
        "training.eval_every=1000",
        "checkpoint.every_steps=10",
    )
    monkeypatch.setenv(chaos.ENV_VAR, "slow-steps:seconds=0.25")
    run = f"{bucket}/runs/outage"
    outage = {}

    def break_the_bucket_mid_run() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if any(e["event"] == "first_step" for e in read_events(run)):
                break
            time.sleep(0.5)
        time.sleep(2)
        outage["from"] = time.time()
        s3.stop()
        time.sleep(8)
        s3.start()
        outage["to"] = time.time()
        chaos.stop_pacing(run)  # the rest of the run at full speed

    breaker = threading.Thread(target=break_the_bucket_mid_run, daemon=True)
    breaker.start()
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    breaker.join(timeout=60)
    assert outage.get("to"), "the outage never happened"
    assert summary["steps"] == steps
    assert read_ledger(run).tolist() == list(range(steps * GLOBAL_BATCH))
    segments = [e for e in read_events(run) if e["event"] == "segment_start"]
    for segment in segments[1:]:  # a restart, if any, restored a complete checkpoint
        assert segment["restored_step"] % 10 == 0


@pytest.mark.parametrize(
    "problem, setting, expected",
    [
        ("no such bucket", {}, "bucket no-such-bucket does not exist"),
        (
            "endpoint away",
            {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
            "at http://127.0.0.1:9",
        ),
        (
            "half the credentials",
            {"AWS_SECRET_ACCESS_KEY": ""},
            "AWS_SECRET_ACCESS_KEY is not set (AWS_ACCESS_KEY_ID is)",
        ),
    ],
)
def test_a_bucket_that_cannot_be_written_is_refused_in_one_line(
    s3, tmp_path, problem, setting, expected
):
    """Exit 2, one line naming the bucket and what is missing, nothing written anywhere."""
    env = {**os.environ, **setting}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain_lm.cli",
            "train",
            "--set",
            "output_dir=s3://no-such-bucket/runs"
            if problem == "no such bucket"
            else f"output_dir={s3.new_bucket()}/runs",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert expected in done.stderr and "output_dir s3://" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unsupported_uri_is_refused_not_folded_into_a_folder(tmp_path):
    with pytest.raises(UserError, match="s3a:// is not a storage"):
        load_config(None, ["output_dir=s3a://bucket/runs"])
