"""A sweep's pictures, drawn from MLflow metric histories: each trial's loss curve (logged to
its own run) and the sweep's report PNG (val loss against each swept key, and the val loss
curves of the best trials).

matplotlib is imported where a picture is drawn: reading or running a sweep needs none.
`Figure`, not pyplot: no global backend switch in a user's notebook kernel.
"""

from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path
from typing import Any

from raytrain_lm.rundir import RunDir
from raytrain_lm.storage import Location, is_uri

LOSS_CURVE = "loss_curve.png"
TOP_CURVES = 3


def metric_history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in MLflow run `run_id`, by step."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def log_loss_curve(client, run_id: str) -> None:
    """Draws the run's train and val loss against step and logs it as `loss_curve.png`."""
    if any(a.path == LOSS_CURVE for a in client.list_artifacts(run_id)):
        return
    train = metric_history(client, run_id, "train/loss")
    if not train:
        return
    val = metric_history(client, run_id, "val/loss")
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


def plot_report(
    rows: list[dict[str, Any]],
    keys: list[str],
    client,
    out: str | Path,
    log_keys: frozenset[str] = frozenset(),
) -> Path | Location:
    """Val loss against each swept key (one panel each), then the val loss curves of the
    best trials. `rows` are ranked trials (`report.collect`). Keys in `log_keys` (sampled
    log-uniformly) get a log axis, as do values that span more than a factor of 20. `out` is
    a local path or a bucket URI."""
    from matplotlib.figure import Figure

    scored = [r for r in rows if r["val_loss"] is not None]
    panels = len(keys) + 1
    cols = min(panels, 3)
    fig = Figure(figsize=(4.5 * cols, 3.6 * math.ceil(panels / cols)))
    axes = fig.subplots(math.ceil(panels / cols), cols)
    axes = list(getattr(axes, "flat", [axes]))
    for ax, key in zip(axes, keys, strict=False):
        _plot_loss_against_key(ax, key, scored, key in log_keys)
    _plot_top_curves(axes[len(keys)], scored, client)
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    return _save_png(fig, out)


def _plot_loss_against_key(ax, key: str, scored: list[dict[str, Any]], log_key: bool) -> None:
    """One panel: each scored trial's val loss at its value of `key`, labelled by trial."""
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
    if numeric:
        _set_numeric_ticks(ax, xs, log_key or max(xs) / min(xs) > 20)
    for x, y, label in zip(xs, ys, labels, strict=True):
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(key)
    ax.set_ylabel("val loss")


def _set_numeric_ticks(ax, xs: list[float], log_axis: bool) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    if log_axis:
        ax.set_xscale("log")
        # 1-2-5 ticks in plain numbers: matplotlib's default labels minor ticks as
        # powers of ten over a narrow range, and they overlap
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    distinct = sorted(set(xs))
    if len(distinct) <= 4:  # a choice: tick exactly its values
        ax.set_xticks(distinct)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _plot_top_curves(curves, scored: list[dict[str, Any]], client) -> None:
    for r in scored[:TOP_CURVES]:
        history = metric_history(client, r["run_id"], "val/loss")
        if history:
            curves.plot(*zip(*history, strict=True), "o-", label=r["trial"])
    curves.set_xlabel("step")
    curves.set_ylabel("val loss")
    curves.set_title(f"top {min(TOP_CURVES, len(scored))} trials")
    if scored:
        curves.legend(fontsize=7)


def _save_png(fig, out: str | Path) -> Path | Location:
    if is_uri(out):  # a bucket: drawn in memory, then one object
        drawn = io.BytesIO()
        fig.savefig(drawn, format="png", dpi=100)
        where = Location(str(out))
        RunDir(where.parent).write_bytes(drawn.getvalue(), where.name)
        return where
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
