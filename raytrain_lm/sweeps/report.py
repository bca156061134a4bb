"""What a sweep found: its trials ranked by val loss, as a table and a PNG, read from MLflow.

MLflow is the record (not Tune's result files): it holds every trial once, including trials
of earlier, interrupted driver processes. `write_report` is what the end of a sweep and
`raytrain-lm sweep report` both run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_lm.errors import UserError
from raytrain_lm.storage import Location
from raytrain_lm.sweeps.plots import plot_report
from raytrain_lm.sweeps.record import REPORT_FILE, read_record
from raytrain_lm.sweeps.runs import (
    TAG_STOPPED_EARLY,
    TAG_TRIAL,
    TrialRuns,
    short_of_its_end,
    steps_trained,
)


def swept_keys(record: dict[str, Any]) -> list[str]:
    """The keys a sweep's report shows: its space, then PBT's mutated keys (whose MLflow
    params are the values a trial started with)."""
    mutations = (record.get("scheduler") or {}).get("hyperparam_mutations") or {}
    return [*record["space"], *(k for k in mutations if k not in record["space"])]


def log_uniform_keys(record: dict[str, Any]) -> frozenset[str]:
    """Keys sampled log-uniformly (in the space, or as a PBT mutation): plotted on a log axis."""
    mutations = (record.get("scheduler") or {}).get("hyperparam_mutations") or {}
    return frozenset(
        key for key, entry in {**mutations, **record["space"]}.items() if "loguniform" in entry
    )


def collect(runs: TrialRuns, keys: list[str]) -> list[dict[str, Any]]:
    """One row per trial run under the sweep's parent, best val loss first (runs without a
    val loss last)."""
    rows = []
    for run in runs.children():
        metrics = run.data.metrics
        # The tag is checked against the run's steps: sweeps of older versions marked trials
        # that trained to their last step after the scheduler's stop.
        trained, planned = None, None
        if run.data.tags.get(TAG_STOPPED_EARLY) == "true":
            trained, planned = steps_trained(runs.client, run)
        rows.append(
            {
                "trial": run.data.tags.get(TAG_TRIAL, "?"),
                "run_name": run.info.run_name,
                "run_id": run.info.run_id,
                "status": run.info.status,
                "stopped_early": trained is not None and short_of_its_end(trained, planned),
                "stopped_at": (trained, planned),
                "val_loss": metrics.get("val/loss"),
                "train_loss": metrics.get("train/loss"),
                "tokens": metrics.get("progress/tokens"),
                "params": {k: run.data.params.get(k) for k in keys},
            }
        )
    rows.sort(key=lambda r: (r["val_loss"] is None, r["val_loss"] or 0.0))
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number.is_integer() and abs(number) < 1e9:
        return str(int(number))
    return f"{number:.4g}"


def format_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    head = ["rank", "trial", "status", "val_loss", "train_loss", "tokens", *keys]
    body = []
    for i, r in enumerate(rows, 1):
        status = r["status"].lower()
        if r["stopped_early"]:
            trained, planned = r["stopped_at"]
            at = f" at step {trained} of {planned}" if planned is not None else ""
            status += f" (stopped early{at})"
        body.append(
            [
                str(i),
                r["trial"],
                status,
                _fmt(r["val_loss"]),
                _fmt(r["train_loss"]),
                _fmt(r["tokens"]),
                *(_fmt(r["params"][k]) for k in keys),
            ]
        )
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(lines)


def write_report(
    record: dict[str, Any], runs: TrialRuns, out: str | Path
) -> tuple[list[dict[str, Any]], str, Path | Location]:
    """Ranks the trials of the sweep `record` describes and draws its PNG to `out` (a local
    path or a bucket URI); returns the ranked rows, the table text and the PNG's location."""
    keys = swept_keys(record)
    rows = collect(runs, keys)
    png = plot_report(rows, keys, runs.client, out, log_uniform_keys(record))
    return rows, format_table(rows, keys), png


def report(name: str, output_dir: str | Path = "runs", out: str | Path | None = None) -> dict:
    """Ranks sweep `name`'s trials; returns the rows, the table text and the PNG's location
    (`output_dir` and `out` may be bucket URIs)."""
    directory, record = read_record(name, output_dir)
    if not record.get("parent_run_id"):
        raise UserError(f"sweep '{name}' has no MLflow run yet (it never started)")
    runs = TrialRuns(record["tracking_uri"], record["parent_run_id"])
    rows, table, png = write_report(record, runs, out or directory / REPORT_FILE)
    return {"rows": rows, "table": table, "png": str(png)}
