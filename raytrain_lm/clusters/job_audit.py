"""The audit records of a job's `submit` and `stop` (audit.py), written where the job's
storage is: by this machine when it can write there (a bucket it has credentials for, or a
cluster whose head runs here), else on the head, by the job's driver (submit) or by a one-line
job (stop)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from raytrain_lm import audit
from raytrain_lm.errors import UserError

WRITER_WAIT_S = 120.0


def record_submit(
    config_yaml: str, storage: str, here: bool, cluster: str, job_id: str, run: str,
    working_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """The submit's record, written before the job is submitted when `here`; else marked for
    the job's driver to write before it trains. It travels with the job (audit.AUDIT_ENV)."""
    record = audit.new_record(
        "submit", cluster=cluster, config_digest=audit.digest(config_yaml), job_id=job_id,
        run=run, working_dir=working_dir,
    )  # fmt: skip
    if not (here and _written(storage, record)):
        record["written_by"] = "job"
    return record


def _written(storage: str, record: dict[str, Any]) -> bool:
    """Writes `record` from this machine; False (said in a line) when it cannot, as a laptop
    without the bucket's credentials, which only the cluster's nodes hold: the head writes
    it instead, and an error there stops the action all the same."""
    try:
        audit.write(storage, record)
    except UserError:
        print(f"[raytrain-lm] this machine cannot write under {audit.folder(storage)}: the "
              "cluster writes the audit record there instead", flush=True)  # fmt: skip
        return False
    return True


def record_stop(
    jobs, storage: str, here: bool, cluster: str, job_id: str, run: str | None, forced: bool
) -> None:
    """The stop's record, before the job is asked to stop."""
    record = audit.new_record(
        "stop --force" if forced else "stop", cluster=cluster, job_id=job_id, run=run
    )
    if here and _written(storage, record):
        return
    writer = jobs.submit_job(
        entrypoint=audit.script_writing(storage, record),
        submission_id=f"{job_id}-audit-{uuid.uuid4().hex[:8]}",
    )
    deadline = time.monotonic() + WRITER_WAIT_S
    state = str(jobs.get_job_status(writer))
    while not state.endswith(("SUCCEEDED", "FAILED", "STOPPED")) and time.monotonic() < deadline:
        time.sleep(1)
        state = str(jobs.get_job_status(writer))
    if not state.endswith("SUCCEEDED"):
        raise UserError(
            f"audit: the record of stopping {job_id} could not be written under "
            f"{storage}/audit on the head ({state}); the job was not stopped"
        )
