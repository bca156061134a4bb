"""What a sweep found: trials ranked by val loss, as a table and a PNG, read from MLflow.

MLflow is the record (not Tune's result files): it holds every trial once, including trials
of earlier, interrupted driver processes.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

LOSS_CURVE = "loss_curve.png"
TOP_CURVES = 3


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def log_loss_curve(client, run_id: str) -> None:
    """Draws the run's train and val loss against step and logs it as `loss_curve.png`."""
    if any(a.path == LOSS_CURVE for a in client.list_artifacts(run_id)):
        return
    train = _history(client, run_id, "train/loss")
    if not train:
        return
    val = _history(client, run_id, "val/loss")
    # Figure, not pyplot: no global backend switch in a user's notebook kernel
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train, strict=True), label="train/loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val/loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(client.get_run(run_id).info.run_name)
    ax.legend()
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / LOSS_CURVE
        fig.savefig(path, dpi=100)
        client.log_artifact(run_id, str(path))


def collect(runs, keys: list[str]) -> list[dict[str, Any]]:
    """One row per trial run under the sweep's parent, best val loss first (runs without a
    val loss last)."""
    from raytrain_lm.sweeps import TAG_STOPPED_EARLY, TAG_TRIAL

    rows = []
    for run in runs.children():
        metrics = run.data.metrics
        rows.append(
            {
                "trial": run.data.tags.get(TAG_TRIAL, "?"),
                "run_name": run.info.run_name,
                "run_id": run.info.run_id,
                "status": run.info.status,
                "stopped_early": run.data.tags.get(TAG_STOPPED_EARLY) == "true",
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
        status = r["status"].lower() + (" (stopped early)" if r["stopped_early"] else "")
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
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def plot_report(
    rows: list[dict[str, Any]],
    keys: list[str],
    client,
    out: str | Path,
    log_keys: frozenset[str] = frozenset(),
) -> Path:
    """Val loss against each swept key (one panel each), then the val loss curves of the
    best trials. Keys in `log_keys` (sampled log-uniformly) get a log axis, as do values that
    span more than a factor of 20."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    scored = [r for r in rows if r["val_loss"] is not None]
    panels = len(keys) + 1
    cols = min(panels, 3)
    fig = Figure(figsize=(4.5 * cols, 3.6 * math.ceil(panels / cols)))
    axes = fig.subplots(math.ceil(panels / cols), cols)
    axes = list(getattr(axes, "flat", [axes]))
    for ax, key in zip(axes, keys, strict=False):
        xs, ys, labels = [], [], []
        for r in scored:
            raw = r["params"][key]
            try:
                xs.append(float(raw))
            except (TypeError, ValueError):
                xs.append(raw)  # a categorical choice: matplotlib places strings in order
            ys.append(r["val_loss"])
            labels.append(r["trial"].split("_")[-1])
        ax.scatter(xs, ys)
        numeric = all(isinstance(x, float) for x in xs) and xs and min(xs) > 0
        if numeric and (key in log_keys or max(xs) / min(xs) > 20):
            ax.set_xscale("log")
            # 1-2-5 ticks in plain numbers: matplotlib's default labels minor ticks as
            # powers of ten over a narrow range, and they overlap
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_minor_formatter(NullFormatter())
        elif numeric:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        if numeric:
            distinct = sorted(set(xs))
            if len(distinct) <= 4:  # a choice: tick exactly its values
                ax.set_xticks(distinct)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        for x, y, label in zip(xs, ys, labels, strict=True):
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(key)
        ax.set_ylabel("val loss")
    curves = axes[len(keys)]
    for r in scored[:TOP_CURVES]:
        history = _history(client, r["run_id"], "val/loss")
        if history:
            curves.plot(*zip(*history, strict=True), "o-", label=r["trial"])
    curves.set_xlabel("step")
    curves.set_ylabel("val loss")
    curves.set_title(f"top {min(TOP_CURVES, len(scored))} trials")
    if scored:
        curves.legend(fontsize=7)
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def report(name: str, output_dir: str | Path = "runs", out: str | Path | None = None) -> dict:
    """Ranks sweep `name`'s trials; returns the rows, the table text and the PNG path."""
    from raytrain_lm.sweeps import (
        SWEEP_FILE,
        TrialRuns,
        log_uniform_keys,
        sweep_directory,
        swept_keys,
    )

    directory = sweep_directory(name, output_dir)
    record = json.loads((directory / SWEEP_FILE).read_text())
    if not record.get("parent_run_id"):
        from raytrain_lm.errors import UserError

        raise UserError(f"sweep '{name}' has no MLflow run yet (it never started)")
    runs = TrialRuns(record["tracking_uri"], record["parent_run_id"])
    keys = swept_keys(record)
    rows = collect(runs, keys)
    png = plot_report(
        rows, keys, runs.client, out or directory / "report.png", log_uniform_keys(record)
    )
    return {"rows": rows, "table": format_table(rows, keys), "png": str(png)}
