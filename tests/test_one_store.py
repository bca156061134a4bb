"""One place for results: a job submitted to a cluster running on this machine (`raytrain-lm
cluster up`'s) writes the runs and prepared data of the submitting working directory, the
ones `raytrain-lm train` and the notebooks there use, so that a fresh clone never resumes
another clone's run; it logs to the cluster's MLflow server, or, on a cluster without one
(`cluster up --no-tracking`), to the working directory's `mlflow.db`. A cluster elsewhere keeps
what docs/clusters.md says: a folder on its head.

The notebooks' side is tests/test_notebooks.py (they write to the checkout's `../runs`,
`../data` and `../mlflow.db`); the CLI's and `mlflow ui`'s, tests/test_readme.py.
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

from raytrain_lm.clusters.jobs import DEFAULT_STORAGE, default_storage, entrypoint, head_runs_here

ROOT = Path(__file__).resolve().parents[1]


def _settings(command: str) -> dict[str, str]:
    """The --set KEY=VALUE pairs of a job's command line."""
    words = shlex.split(command)
    return dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--set")


def test_a_job_on_a_cluster_running_here_writes_into_the_working_dir(ray_session, tmp_path):
    """The session's Ray serves its dashboard on this machine, as `cluster up`'s does."""
    url = f"http://{ray_session._private.worker.get_dashboard_url()}"
    assert head_runs_here(url)
    storage = default_storage(url, tmp_path)
    assert storage == str(tmp_path.resolve())
    moved = _settings(entrypoint("experiments/demo.yaml", ["name=x"], ROOT, storage)[0])
    assert moved["output_dir"] == f"{storage}/runs"
    assert moved["data.cache_dir"] == f"{storage}/data"
    # The cluster's server where its head says so (`cluster up`'s does), else the checkout's.
    assert moved["tracking.uri"] == f"${{MLFLOW_TRACKING_URI:-sqlite:///{storage}/mlflow.db}}"


def test_a_job_on_a_cluster_elsewhere_keeps_the_heads_folder(tmp_path):
    # A tunnel to a remote head (`ray dashboard`, `kubectl port-forward`) listens on a
    # loopback port too, in a process that is not Ray's dashboard.
    with socket.socket() as tunnel:
        tunnel.bind(("127.0.0.1", 0))
        tunnel.listen()
        url = f"http://127.0.0.1:{tunnel.getsockname()[1]}"
        assert not head_runs_here(url)
        assert default_storage(url, tmp_path) == DEFAULT_STORAGE
    assert not head_runs_here("http://203.0.113.7:8265")  # not this machine: nothing asked
