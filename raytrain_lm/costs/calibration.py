"""Planning inputs measured by a run that already ran (`raytrain-lm plan --from RUN`): its
tokens/s and MFU per accelerator type (summary.json), its recovery time per incident and spot
interruptions per node-hour (the goodput events), and how long a checkpoint took to save
(`checkpoint_saved` events). What a run did not measure stays assumed."""

from __future__ import annotations

import json
import math
import statistics

from raytrain_lm.costs.catalog import Catalog
from raytrain_lm.run_events.goodput import summarize
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RunDir


def measured_inputs(run_dir: RunDir, catalog: Catalog) -> dict:
    """The figures `run_dir` measured, as keyword arguments of `planner.Inputs` (with
    `measured`: what each came from)."""
    measured: list[str] = []
    found: dict = {}
    text = run_dir.read_text("summary.json")
    summary = json.loads(text) if text else {}
    events = read_events(run_dir)
    mfu = {
        _catalog_key(kind, catalog): figures["mfu"]
        for kind, figures in (summary.get("per_type") or {}).items()
        if _catalog_key(kind, catalog) and figures.get("mfu")
    }
    if mfu:
        found["mfu"] = mfu
        measured += [f"MFU on {kind} ({value:.1%})" for kind, value in mfu.items()]
    goodput = summarize(events)
    incidents = goodput.restarts
    if incidents:
        found["recovery_s"] = goodput.recovery_s / incidents
        measured.append(
            f"recovery per incident ({found['recovery_s']:.0f} s, {incidents} incidents)"
        )
    node_hours = _node_hours(events, catalog)
    if node_hours and goodput.preemptions:  # none over a short run says little: keep the catalog's
        rates = {kind: goodput.preemptions / hours for kind, hours in node_hours.items()}
        found["interruptions_per_node_hour"] = rates
        measured += [
            f"interruptions on {kind} ({rate:.3f} per node-hour over {node_hours[kind]:.1f} node-hours)"
            for kind, rate in rates.items()
        ]
    saves = [e["save_s"] for e in events if e["event"] == "checkpoint_saved"]
    if saves:
        found["checkpoint_s"] = statistics.median(saves)
        measured.append(f"checkpoint save ({found['checkpoint_s']:.1f} s, median of {len(saves)})")
    found["measured"] = measured
    return found


def _node_hours(events: list[dict], catalog: Catalog) -> dict[str, float]:
    """Node-hours each catalogued type ran, from the worker groups' lifetimes: a spot type's
    interruptions are counted against them."""
    hours: dict[str, float] = {}
    starts = [e for e in events if e["event"] == "segment_start"]
    ends = {e["segment"]: e["t"] for e in events if e["event"] == "segment_end"}
    for start in starts:
        until = ends.get(start["segment"])
        if until is None:
            continue
        for kind in set(start.get("types") or []):
            key = _catalog_key(kind, catalog)
            if key:
                workers = start["types"].count(kind)
                nodes = math.ceil(workers / catalog.types[key].gpus_per_node)
                hours[key] = hours.get(key, 0.0) + nodes * (until - start["t_start"]) / 3600
    return hours


def _catalog_key(kind: str, catalog: Catalog) -> str | None:
    """The catalog's entry for a type a run reported, as prices are looked up: the same name
    (case aside), else the longest catalog name it contains ("A100" for "A100-80G")."""
    for key in sorted(catalog.types, key=len, reverse=True):
        if key.upper() == kind.upper() or key.upper() in kind.upper():
            return key
    return None
