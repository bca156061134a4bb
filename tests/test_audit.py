"""The audit trail (raytrain_lm/audit.py): what a record holds, that the log only grows (in a
folder and in a bucket), that a record that cannot be written stops the action, and
`raytrain-lm audit` as a user types it. A submitted job's records on the local cluster are in
test_jobs.py; a promotion's in test_registry.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_lm import audit, cli
from raytrain_lm.errors import UserError


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git checkout with one commit, as the working directory."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for command in (
        ["git", "init", "-q"],
        ["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty",
         "-m", "first"],
    ):  # fmt: skip
        subprocess.run(command, cwd=checkout, check=True)
    (checkout / "train.py").write_text("print(1)\n")
    subprocess.run(["git", "add", "train.py"], cwd=checkout, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "code"],
                   cwd=checkout, check=True)  # fmt: skip
    monkeypatch.chdir(checkout)
    return checkout


def test_a_record_says_who_ran_what_from_which_code_and_hides_secrets(repo, monkeypatch):
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.setattr(sys, "argv", [
        "/home/ann/venv/bin/raytrain-lm", "submit", "--set", "tracking.uri=postgresql://ann:s3cret@db/mlflow",
        "--set", "data.hf_token=hf_abc", "--set", "optim.lr=3e-4", "--data.api_key", "k2",
    ])  # fmt: skip
    record = audit.new_record("submit", cluster="https://ann:pw@head", job_id="j1", run="r1")
    assert record["cluster"] == "https://ann:***@head"
    assert record["git_commit"] == head.strip() and record["git_dirty"] is False
    assert record["command"][:2] == ["raytrain-lm", "submit"]  # as typed, wherever it ran
    assert record["command"][3:] == [
        "tracking.uri=postgresql://ann:***@db/mlflow", "--set", "data.hf_token=***",
        "--set", "optim.lr=3e-4", "--data.api_key", "***",
    ]  # fmt: skip
    for secret in ("s3cret", "hf_abc", "k2", ":pw@"):
        assert secret not in json.dumps(record), secret
    (repo / "train.py").write_text("print(2)\n")
    assert audit.new_record("stop")["git_dirty"] is True
    tags = audit.mlflow_tags(record)
    assert tags["raytrain_lm.audit.job_id"] == "j1" and "raytrain_lm.audit.mlflow_run" not in tags


def test_the_log_only_grows_one_object_per_record_and_reads_back_filtered(tmp_path):
    first = audit.new_record("submit", run="a", job_id="a-1")
    paths = [audit.write(tmp_path, first), audit.write(tmp_path, first)]  # the same facts twice
    audit.write(tmp_path, audit.new_record("promote", run="b"))
    assert len(set(paths)) == 2 and len(list((tmp_path / "audit").iterdir())) == 3
    assert [r["action"] for r in audit.read(tmp_path, run="a")] == ["submit", "submit"]
    assert audit.read(tmp_path, since=audit.since_time("1h")) == audit.read(tmp_path)
    assert audit.read(tmp_path, since=audit.since_time("2999-01-01")) == []
    with pytest.raises(UserError, match="--since 'yesterday': write a duration"):
        audit.since_time("yesterday")


def test_the_log_sits_beside_the_runs_folder():
    assert audit.storage_of("runs") == "." and audit.storage_of("/data/team/runs/") == "/data/team"
    assert audit.storage_of("s3://bucket/team/runs") == "s3://bucket/team"
    assert audit.storage_of("s3://bucket") == "s3://bucket"  # runs at a bucket's root


def test_a_submitter_that_cannot_write_the_log_leaves_it_to_the_cluster(tmp_path, capsys):
    """A laptop without the bucket's credentials (only the nodes hold them): the job's driver
    writes the record instead, and stops the run if it cannot either."""
    from raytrain_lm.clusters import job_audit

    (tmp_path / "audit").write_text("not a folder")
    record = job_audit.record_submit("a: 1\n", str(tmp_path), True, "http://h", "j", "r", tmp_path)
    assert record["written_by"] == "job" and "the cluster writes the audit record" in (
        capsys.readouterr().out
    )
    record = job_audit.record_submit("a: 1\n", str(tmp_path / "ok"), True, "http://h", "j", "r",
                                     tmp_path)  # fmt: skip
    assert "written_by" not in record and len(audit.read(tmp_path / "ok")) == 1


def test_a_record_in_a_bucket_is_a_new_object(s3):
    bucket = f"{s3.new_bucket()}/team"
    written = audit.write(bucket, audit.new_record("sweep", run="lr"))
    again = audit.write(bucket, audit.new_record("sweep", run="lr"))
    assert written != again and s3.keys(bucket) == sorted(
        path.removeprefix(f"{bucket}/") for path in (written, again)
    )
    assert [r["run"] for r in audit.read(bucket)] == ["lr", "lr"]


def test_an_unwritable_log_stops_the_action_in_one_line(tmp_path, monkeypatch, capsys):
    """`cluster down` with the audit log's folder blocked (a file where the folder goes): one
    line, exit 2, and the command did not run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "audit").write_text("not a folder")
    with pytest.raises(UserError, match="audit: cannot write the record of `cluster down` under"):
        cli.run(["cluster", "down", "--dir", str(tmp_path / "nothing-here")])
    assert "local cluster down" not in capsys.readouterr().out


def test_the_audit_command_lists_the_records(tmp_path, capsys):
    audit.write(tmp_path, audit.new_record("submit", run="a", job_id="a-1", cluster="http://h"))
    audit.write(tmp_path, audit.new_record("stop", run="a", job_id="a-1"))
    audit.write(tmp_path, audit.new_record("sweep", run="b"))
    assert cli.run(["audit", "--storage", str(tmp_path), "--run", "a", "--since", "10m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["submit", "stop"]
    assert "run=a job_id=a-1 cluster=http://h" in lines[0]
    assert cli.run(["audit", "--storage", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.startswith("no records under")


def test_a_remote_heads_record_is_written_by_a_one_line_standard_library_script(tmp_path):
    """What a stop sends to a remote head whose storage is a folder there: run here as the
    head's shell would, two stops leave two records that read back as they were sent, and the
    same command run again never overwrites its record."""
    record = audit.new_record("stop", run="far", job_id="far-1")
    storage = str(tmp_path / "head-storage")
    commands = [audit.script_writing(storage, record) for _ in range(2)]
    # The job's `python` is the cluster's; only the standard library is needed
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    for command in commands:
        subprocess.run(["bash", "-c", command], check=True, env={"PATH": path})
    assert audit.read(storage) == [record, record]
    again = subprocess.run(["bash", "-c", commands[0]], capture_output=True, env={"PATH": path})
    assert again.returncode != 0 and b"FileExistsError" in again.stderr
    assert audit.read(storage) == [record, record]


def test_a_jobs_driver_writes_the_record_its_submitter_could_not_and_tags_its_run(
    tmp_path, monkeypatch
):
    """A folder on a remote head: `submit` marks the record for the job (clusters/job_audit.py);
    the driver writes it above its `output_dir` before the run starts, and tags its run."""
    record = audit.new_record("submit", job_id="far-1", run="far", cluster="http://head:8265")
    marked = {**record, "written_by": "job"}
    monkeypatch.setenv(audit.AUDIT_ENV, json.dumps(marked))
    tags = audit.job_record(f"{tmp_path}/runs")
    assert audit.read(tmp_path) == [record] and tags == audit.mlflow_tags(record)
    monkeypatch.setenv(audit.AUDIT_ENV, json.dumps(record))  # written by its submitter already
    assert audit.job_record(f"{tmp_path}/runs") == tags and len(audit.read(tmp_path)) == 1
    monkeypatch.delenv(audit.AUDIT_ENV)
    assert audit.job_record(f"{tmp_path}/runs") == {}  # not a submitted job
