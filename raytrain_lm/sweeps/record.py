"""A sweep's folder and its `sweep.json`, the record of what defines the sweep and where its
MLflow runs are: written once, then the same sweep name must mean the same sweep.

Layout under `<output_dir>/<sweep name>/`: `sweep.json`, `tune/` (Tune's experiment state),
`trials/<sweep>-<trial id>/` (the trials' run directories), `report.png`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain_lm.errors import UserError
from raytrain_lm.sweeps.spec import Sweep

SWEEP_FILE = "sweep.json"
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
REPORT_FILE = "report.png"


def sweep_record(sweep: Sweep, uri: str) -> dict[str, Any]:
    """The saved record of `sweep` (refused when it differs in what defines the sweep), or a
    new one tracked at `uri`."""
    path = sweep.directory / SWEEP_FILE
    defining = {
        "space": sweep.spec.space,
        "num_samples": sweep.spec.num_samples,
        "search": sweep.spec.search,
        "scheduler": sweep.spec.scheduler.model_dump(),
        "base": sweep.base,
    }
    if path.is_file():
        saved = json.loads(path.read_text())
        for key, value in defining.items():
            if json.loads(json.dumps(value)) != saved.get(key):
                raise UserError(
                    f"sweep '{sweep.name}' exists in {sweep.directory} with a different {key}; "
                    f"resume it unchanged or choose another name"
                )
        return saved
    return {"name": sweep.name, "tracking_uri": uri, "source": sweep.source, **defining}


def save_record(directory: Path, record: dict[str, Any]) -> None:
    (directory / SWEEP_FILE).write_text(json.dumps(record, indent=2))


def read_record(name: str, output_dir: str | Path = "runs") -> tuple[Path, dict[str, Any]]:
    """The folder and record of sweep `name` under `output_dir`."""
    directory = Path(output_dir).resolve() / name
    if not (directory / SWEEP_FILE).is_file():
        raise UserError(f"no sweep '{name}' in {Path(output_dir).resolve()} (no {SWEEP_FILE})")
    return directory, json.loads((directory / SWEEP_FILE).read_text())
