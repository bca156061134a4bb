"""`raytrain-lm submit|status|logs|stop`: training runs as Ray jobs on a (remote) cluster,
through the Ray Jobs API.

The job runs `python -m raytrain_lm.cli train ...` in the uploaded working directory, so the
driver and every Train worker import the code the user has locally, not whatever version the
cluster's setup installed. Clusters run with token auth: the client needs the cluster's token
(`ray get-auth-token` on the head) in ~/.ray/auth_token or $RAY_AUTH_TOKEN.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from raytrain_lm import audit
from raytrain_lm.clusters import job_audit
from raytrain_lm.clusters.autoscaling import read_state
from raytrain_lm.config import DEFAULT_TRACKING_DB, TRACKING_URI_ENV, to_yaml
from raytrain_lm.errors import UserError
from raytrain_lm.trainer.chaos import ENV_VAR as FAULT_ENV_VAR
from raytrain_lm.trainer.driver.stopping import STOP_ACKNOWLEDGED

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Ray refuses uploads over 100 MiB; datasets, runs and environments are the usual culprits.
# Run and data folders go wherever they are (not only at the top: notebooks/runs of an older
# checkout), except the package's own data code. Gitignore patterns: the last one matching a
# path decides.
UPLOAD_EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "data/",
    "runs/",
    "!/raytrain_lm/data/",
    "mlruns/",
    "mlartifacts/",
    "mlflow.db",
    "/audit/",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    "/benchmarks/results",
    "*.safetensors",
    "*.parquet",
]
# ray/_private/ray_constants.py: what Ray leaves out of every working dir unless told.
RAY_DEFAULT_EXCLUDES_ENV = "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES"
DEFAULT_STORAGE = "$HOME/raytrain-lm"
_SAFE_STORAGE = re.compile(r"^[A-Za-z0-9_./$~+-]+$")
# A bucket and an optional prefix, in the schemes pyarrow.fs writes run state to. No `$` or
# `~`: nothing in a bucket URI is expanded on the head.
_BUCKET_STORAGE = re.compile(
    r"^(s3|gs|gcs)://[A-Za-z0-9][A-Za-z0-9._-]{1,254}(/[A-Za-z0-9_.+=-]+)*/?$"
)


def resolve_address(address: str | None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS / $RAY_ADDRESS, else a `cluster up` cluster,
    else the dashboard on this machine."""
    if address:
        chosen = address
    elif os.environ.get("RAY_API_SERVER_ADDRESS"):
        chosen = os.environ["RAY_API_SERVER_ADDRESS"]
    elif os.environ.get("RAY_ADDRESS", "").startswith("http"):
        chosen = os.environ["RAY_ADDRESS"]
    else:
        state = read_state()
        chosen = state["dashboard"] if state and state.get("dashboard") else DEFAULT_ADDRESS
    if not chosen.startswith(("http://", "https://")):
        chosen = f"http://{chosen}"
    return chosen


def head_runs_here(url: str) -> bool:
    """Whether the job server at `url` is a Ray dashboard running on this machine (as for
    `raytrain-lm cluster up`), so that the cluster's processes see this machine's files. A
    loopback address alone does not say it: a `ray dashboard` tunnel or a `kubectl
    port-forward` to a remote head listens there too, in a process that is not Ray's."""
    import psutil

    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1") or parsed.port is None:
        return False
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return False
    for connection in connections:
        if connection.status != psutil.CONN_LISTEN or connection.laddr.port != parsed.port:
            continue
        try:
            command = psutil.Process(connection.pid).cmdline() if connection.pid else []
        except psutil.Error:
            continue
        if any(part.endswith(os.path.join("ray", "dashboard", "dashboard.py")) for part in command):
            return True
    return False


def default_storage(address: str | None, working_dir: str | Path) -> str:
    """Where a job's relative outputs go when `--storage` is not given. On a cluster whose
    head runs on this machine (`raytrain-lm cluster up`): the submitting working directory,
    whose runs/, data/ and mlflow.db `raytrain-lm train` and the notebooks use too, so a job
    resumes the run of its name in this checkout and never another clone's. On any other
    cluster: DEFAULT_STORAGE, a folder on its head."""
    if not head_runs_here(resolve_address(address)):
        return DEFAULT_STORAGE
    here = str(Path(working_dir).resolve())
    if not _SAFE_STORAGE.fullmatch(here):
        raise UserError(
            f"the working dir {here} has characters a job's command line cannot carry; "
            f"choose where the job writes with --storage DIR"
        )
    return here


def client(address: str | None):
    """A JobSubmissionClient that sends the auth token; one-line errors for the usual failures."""
    # Without the mode the SDK sends no token, even when one is on disk (the server says 401).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    url = resolve_address(address)
    try:
        return JobSubmissionClient(url)
    except Exception as exc:  # the SDK raises ConnectionError/RuntimeError with long texts
        raise UserError(f"cannot reach the Ray job server at {url}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if "401" in text or "403" in text or "nauthorized" in text or "orbidden" in text:
        return (
            "authentication refused; put the cluster's token (`ray get-auth-token` on the "
            "head) in ~/.ray/auth_token or $RAY_AUTH_TOKEN"
        )
    return text.splitlines()[0] if text else type(exc).__name__


def _storage_arg(value: str) -> str:
    # Double quotes so that $HOME expands on the head, not here.
    return f'"{value}"'


def is_bucket_storage(storage: str) -> bool:
    return "://" in storage


def check_storage(storage: str) -> str:
    """`storage` without a trailing slash: a folder on the head, or `s3://BUCKET[/PREFIX]` /
    `gs://BUCKET[/PREFIX]`; anything else is a one-line UserError."""
    if is_bucket_storage(storage):
        if not _BUCKET_STORAGE.fullmatch(storage):
            raise UserError(
                f"--storage {storage!r}: a bucket is s3://BUCKET/PREFIX or gs://BUCKET/PREFIX "
                f"(letters, digits and . _ - in the bucket name)"
            )
        if any(part in (".", "..") for part in storage.split("://", 1)[1].split("/")):
            raise UserError(f"--storage {storage!r}: no . or .. in a bucket prefix")
    elif not _SAFE_STORAGE.fullmatch(storage):
        raise UserError(f"--storage {storage!r}: use letters, digits and / . _ - $ ~ only")
    return storage.rstrip("/")


def entrypoint(
    config: str | None,
    overrides: list[str],
    working_dir: Path,
    storage: str = DEFAULT_STORAGE,
) -> tuple[str, Any]:
    """The job's shell command, and the validated config. Relative output paths would land in
    the job's throwaway copy of the working dir, so they move under `storage`: a folder on the
    head, or a bucket (`s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`) that every node reaches, so
    that `output_dir=runs` becomes `{storage}/runs` and `data.cache_dir=data` `{storage}/data`.
    A config naming no tracking store logs to the cluster's server ($MLFLOW_TRACKING_URI on
    the head), else to a sqlite file under `storage`. A sqlite file cannot live in a bucket:
    with bucket storage it goes under DEFAULT_STORAGE on the head instead."""
    from raytrain_lm.config import load_config

    cfg = load_config(config, overrides)
    storage = check_storage(storage)
    args = ["python", "-m", "raytrain_lm.cli", "train"]
    if config is not None:
        path = Path(config).resolve()
        try:
            args.append(shlex.quote(path.relative_to(working_dir.resolve()).as_posix()))
        except ValueError:
            raise UserError(
                f"{config} is outside the working dir {working_dir}: the job only sees the "
                f"uploaded directory"
            ) from None
    moved = _moved_outputs(cfg, storage)
    moved_keys = {item.partition("=")[0] for item in moved}
    for item in overrides:
        # A relative path the user set is moved below (where it wins over a section's value,
        # `data={cache_dir: ...}`, given here).
        if item.partition("=")[0].strip() not in moved_keys:
            args += ["--set", shlex.quote(item)]
    for item in moved:
        args += ["--set", _storage_arg(item)]
    if cfg.scaling.ray_address is None:
        # The driver joins the cluster the job runs on instead of starting a Ray of its own.
        args += ["--set", "scaling.ray_address=auto"]
    return " ".join(args), cfg


def _moved_outputs(cfg, storage: str) -> list[str]:
    """`KEY=VALUE` settings that move the config's relative outputs under `storage`."""
    moved = []
    if not os.path.isabs(cfg.output_dir) and "://" not in cfg.output_dir:
        moved.append(f"output_dir={storage}/{cfg.output_dir}")
    if not os.path.isabs(cfg.data.cache_dir) and "://" not in cfg.data.cache_dir:
        moved.append(f"data.cache_dir={storage}/{cfg.data.cache_dir}")
    if not cfg.tracking.enabled:
        return moved
    uri = cfg.tracking.uri or f"sqlite:///{DEFAULT_TRACKING_DB}"
    database = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///") and not database.startswith(("/", ":memory:")):
        database_storage = DEFAULT_STORAGE if is_bucket_storage(storage) else storage
        on_head = f"sqlite:///{database_storage}/{database.removeprefix('./')}"
        # A config that names no store logs where the cluster's nodes say (the server its head
        # runs: cluster configs and `cluster up` set the variable for Ray), expanded by the
        # head's shell; a sqlite file under the storage only where none is set.
        moved.append(
            f"tracking.uri=${{{TRACKING_URI_ENV}:-{on_head}}}" if cfg.tracking.uri is None
            else f"tracking.uri={on_head}"
        )  # fmt: skip
    return moved


AGENT_WAIT_S = 120
STOP_MARGIN_S = 30  # beyond fault.stop_timeout_s, for the driver to publish and exit


def submit(
    config: str | None,
    overrides: list[str],
    address: str | None = None,
    working_dir: str | Path = ".",
    storage: str | None = None,
    job_id: str | None = None,
) -> dict[str, str]:
    """Submits `train` as a job; `storage` None: `default_storage`'s choice."""
    working = Path(working_dir)
    if not working.is_dir():
        raise UserError(f"working dir not found: {working_dir}")
    storage = storage or default_storage(address, working)
    command, cfg = entrypoint(config, overrides, working, storage)
    jobs = client(address)
    submission_id = job_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    record = job_audit.record_submit(
        to_yaml(cfg), storage, writable_here(storage, address), resolve_address(address),
        submission_id, cfg.name, working,
    )  # fmt: skip
    # Ray's own default excludes are among UPLOAD_EXCLUDES: turned off (an empty list, as Ray
    # documents), Ray no longer warns at every submit that it leaves each of them out.
    os.environ.setdefault(RAY_DEFAULT_EXCLUDES_ENV, "")
    # A head that just started may not have its job agent registered yet; the server says
    # "try again later", so do, for a while.
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            submitted = jobs.submit_job(
                entrypoint=command,
                submission_id=submission_id,
                runtime_env={
                    "working_dir": str(working.resolve()),
                    "excludes": UPLOAD_EXCLUDES,
                    "env_vars": {
                        "RAY_TRAIN_V2_ENABLED": "1",
                        # torchft's Lighthouse and managers (replica groups) log every quorum
                        # and vote at INFO; they start in the job's processes on the nodes.
                        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
                        # Read by the job's supervisor: how long after `stop`'s SIGTERM it
                        # kills the driver. The driver's graceful stop needs up to
                        # fault.stop_timeout_s for its checkpoint.
                        "RAY_JOB_STOP_WAIT_TIME_S": str(
                            math.ceil(cfg.fault.stop_timeout_s + STOP_MARGIN_S)
                        ),
                        # Chaos tests' injected faults (trainer/chaos.py) travel with the job.
                        **{k: v for k, v in os.environ.items() if k == FAULT_ENV_VAR},
                        audit.AUDIT_ENV: json.dumps(record),
                    },
                },
                metadata={"raytrain_lm_run": cfg.name, "raytrain_lm_storage": storage},
            )
            break
        except Exception as exc:
            if "No available agent" in str(exc) and time.monotonic() < deadline:
                time.sleep(3)
                continue
            raise UserError(f"submit failed: {_first_line(exc)}") from None
    return {
        "job_id": submitted,
        "entrypoint": command,
        "address": resolve_address(address),
        "storage": check_storage(storage),
    }


def status(job_id: str, address: str | None = None) -> dict[str, Any]:
    jobs = client(address)
    try:
        info = jobs.get_job_info(job_id)
    except Exception as exc:
        raise UserError(f"job {job_id}: {_first_line(exc)}") from None
    return {
        "job_id": job_id,
        "status": getattr(info.status, "value", str(info.status)),
        "message": info.message or "",
        "entrypoint": info.entrypoint,
    }


def logs(job_id: str, address: str | None = None, follow: bool = False) -> str | None:
    """The job's log so far, or with `follow`, prints it as it grows until the job ends."""
    jobs = client(address)
    try:
        if not follow:
            return jobs.get_job_logs(job_id)

        async def _tail() -> None:
            async for chunk in jobs.tail_job_logs(job_id):
                print(chunk, end="", flush=True)

        asyncio.run(_tail())
        return None
    except Exception as exc:
        raise UserError(f"job {job_id}: {_first_line(exc)}") from None


def stop(job_id: str, address: str | None = None) -> str:
    """Asks a running job to stop: its driver checkpoints at the next step and ends the run
    (resumable by submitting it again). Asked again while that is under way, ends the driver
    at once instead. Returns what happened: `stopping`, `forced` or `already finished`."""
    jobs = client(address)
    try:
        info = jobs.get_job_info(job_id)
        if getattr(info.status, "value", str(info.status)) in ("SUCCEEDED", "FAILED", "STOPPED"):
            return "already finished"
        forced = STOP_ACKNOWLEDGED in jobs.get_job_logs(job_id)
        _audit_stop(jobs, info, job_id, address, forced)
        if forced:
            _force(jobs, info, job_id)
            return "forced"
        jobs.stop_job(job_id)
        return "stopping"
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"job {job_id}: {_first_line(exc)}") from None


def writable_here(storage: str, address: str | None) -> bool:
    """Whether this machine writes to the job's storage itself: a bucket, or a folder of a
    cluster whose head runs here."""
    return is_bucket_storage(storage) or head_runs_here(resolve_address(address))


def _audit_stop(jobs, info, job_id: str, address: str | None, forced: bool) -> None:
    metadata = info.metadata or {}
    # A job submitted some other way went where this machine's jobs would go by default.
    storage = metadata.get("raytrain_lm_storage") or default_storage(address, ".")
    job_audit.record_stop(
        jobs, storage, writable_here(storage, address), resolve_address(address), job_id,
        metadata.get("raytrain_lm_run"), forced,
    )  # fmt: skip


def _force(jobs, info, job_id: str) -> None:
    """Kills a stopping job's driver (and its process group) with a one-line job on the node
    it runs on: Ray's own stop signals a driver once, and has no second, harder signal.
    The run loses the steps since its last checkpoint, and its resource request expires by
    itself (about 3 minutes) instead of being withdrawn."""
    driver = getattr(info, "driver_info", None)
    if driver is None or not driver.pid:
        raise UserError(f"job {job_id}: its driver is not known to Ray yet; try again shortly")
    kill = (
        f"python -c 'import os, signal; os.killpg(os.getpgid({int(driver.pid)}), signal.SIGKILL)'"
    )
    # Entrypoints run on the head node, as the driver it kills does (submit asks for no
    # entrypoint resources that would place it elsewhere).
    jobs.submit_job(entrypoint=kill, submission_id=f"{job_id}-force-{time.strftime('%H%M%S')}")
