"""A sweep's folder and its `sweep.json`, the record of what defines the sweep and where its
MLflow runs are: written once, then the same sweep name must mean the same sweep.

Layout under `<output_dir>/<sweep name>/` (a local folder or a prefix in a bucket, read and
written through `rundir.RunDir`): `sweep.json`, `tune/` (Tune's experiment state),
`trials/<sweep>-<trial id>/` (the trials' run directories), `starts/<sweep>-<trial id>/` (one
object per start of the trial's Tune actor: object stores cannot append), `report.png`.
Sweeps begun before the starts were objects have `trials/<sweep>-<trial id>.starts` instead,
one JSON line per start; it is still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raytrain_lm.errors import UserError
from raytrain_lm.rundir import RunDir
from raytrain_lm.storage import Location, is_uri
from raytrain_lm.sweeps.spec import Sweep, sweep_directory

SWEEP_FILE = "sweep.json"
TUNE_DIR = "tune"
TRIALS_DIR = "trials"
STARTS_DIR = "starts"
LEGACY_STARTS_SUFFIX = ".starts"
REPORT_FILE = "report.png"


def sweep_record(sweep: Sweep, uri: str) -> dict[str, Any]:
    """The saved record of `sweep` (refused when it differs in what defines the sweep), or a
    new one tracked at `uri`."""
    saved_text = RunDir(sweep.directory).read_text(SWEEP_FILE)
    defining = {
        "space": sweep.spec.space,
        "num_samples": sweep.spec.num_samples,
        "search": sweep.spec.search,
        "scheduler": sweep.spec.scheduler.model_dump(),
        "base": sweep.base,
    }
    if saved_text is not None:
        saved = json.loads(saved_text)
        for key, value in defining.items():
            if json.loads(json.dumps(value)) != saved.get(key):
                raise UserError(
                    f"sweep '{sweep.name}' exists in {sweep.directory} with a different {key}; "
                    f"resume it unchanged or choose another name"
                )
        return saved
    return {"name": sweep.name, "tracking_uri": uri, "source": sweep.source, **defining}


def save_record(directory: str | Path, record: dict[str, Any]) -> None:
    RunDir(str(directory)).write_text(json.dumps(record, indent=2), SWEEP_FILE)


def read_record(name: str, output_dir: str | Path = "runs") -> tuple[Location, dict[str, Any]]:
    """The folder (a local path or a bucket URI) and record of sweep `name` under
    `output_dir`."""
    directory = sweep_directory(output_dir, name)
    text = RunDir(directory).read_text(SWEEP_FILE)
    if text is None:
        where = output_dir if is_uri(output_dir) else Path(output_dir).resolve()
        raise UserError(f"no sweep '{name}' in {where} (no {SWEEP_FILE})")
    return directory, json.loads(text)


def record_start(directory: str | Path, run_name: str, entry: dict[str, Any]) -> None:
    """Notes one start of trial `run_name`'s Tune actor (as its own object)."""
    starts = RunDir(str(directory))
    starts.write_text(json.dumps(entry), STARTS_DIR, run_name, starts.new_object_name(".json"))


def trial_starts(directory: str | Path, run_name: str) -> list[dict[str, Any]]:
    """Every start of trial `run_name` in the sweep at `directory`, oldest first."""
    sweep_dir = RunDir(str(directory))
    legacy = sweep_dir.read_text(TRIALS_DIR, run_name + LEGACY_STARTS_SUFFIX) or ""
    found = [json.loads(line) for line in legacy.splitlines() if line.strip()]
    for object_name in sweep_dir.list_files(STARTS_DIR, run_name):
        if not object_name.endswith(".json"):
            continue  # a local write in progress (see RunDir.write_bytes)
        found.append(json.loads(sweep_dir.read_text(STARTS_DIR, run_name, object_name) or "{}"))
    return found
