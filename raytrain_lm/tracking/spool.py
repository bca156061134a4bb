"""Unsent metrics on local disk, one file per run and process: a worker that ends while the
store is down leaves them there, and the driver's tracker for the same run sends them."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

SPOOL_ENV = "RAYTRAIN_LM_TRACKING_SPOOL"


def spool_dir() -> Path:
    return Path(os.environ.get(SPOOL_ENV) or Path(tempfile.gettempdir()) / "raytrain-lm-spool")


def own_spool(run_id: str) -> Path:
    """This process's spool file for run `run_id`."""
    return spool_dir() / f"{run_id}.{os.getpid()}.jsonl"


def write_spool(file: Path, metrics: list) -> None:
    """Replaces `file` with `metrics` (MLflow `Metric`s); none leaves it as it is."""
    rows = [[m.key, m.value, m.timestamp, m.step] for m in metrics]
    if not rows:
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(file)
    except OSError:
        pass  # a full or read-only disk: the metrics still sit in memory


def spooled_by_others(run_id: str, own: Path) -> Iterator[tuple[Path, list]]:
    """Each spool file of run `run_id` but `own`, with its metrics (MLflow `Metric`s); a file
    that cannot be read is skipped. The caller removes a file once it holds its metrics."""
    from mlflow.entities import Metric

    folder = spool_dir()
    if not folder.is_dir():
        return
    for file in sorted(folder.glob(f"{run_id}.*.jsonl")):
        if file == own:
            continue
        try:
            rows = [json.loads(line) for line in file.read_text().splitlines() if line]
        except (OSError, ValueError):
            continue
        yield file, [Metric(k, float(v), int(t), int(s)) for k, v, t, s in rows]
