"""Checks at the start of a run that a local `output_dir` or data folder is one every node of
the cluster sees (a bucket is checked by `storage.check_writable`). Each failure is one line
that says what to change."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from raytrain_lm.config import RunConfig
from raytrain_lm.data.manifest import MANIFEST_FILE
from raytrain_lm.errors import UserError
from raytrain_lm.rundir import CONFIG_FILE
from raytrain_lm.storage import PROBE_PREFIX, is_uri


def check_nodes_see(cfg: RunConfig, data_dir: str) -> None:
    """On a cluster of several nodes, a local `output_dir` or prepared-data folder must be one
    every node sees (a shared filesystem): refuses at start, naming the nodes that do not,
    instead of failing late on a node that has no such folder. Nodes that join later are
    checked by the workers themselves (`check_worker_sees`)."""
    import ray

    local = [
        (w, p) for w, p in (("output_dir", cfg.output_dir), ("data", data_dir)) if not is_uri(p)
    ]
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not local or len(nodes) <= 1:
        return
    output = Path(cfg.output_dir)
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    probe = output / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"
    probe.write_text("probe")
    paths = {"output_dir": str(probe), "data": str(Path(data_dir, MANIFEST_FILE))}
    try:
        blind = _nodes_missing(nodes, {w: paths[w] for w, _ in local})
    finally:
        probe.unlink(missing_ok=True)
        if created:
            shutil.rmtree(output, ignore_errors=True)
    for what, path in local:
        if blind.get(what):
            shown = "data.cache_dir" if what == "data" else what
            raise UserError(
                f"{shown} {path} is a local folder that {len(blind[what])} node(s) of the "
                f"cluster cannot see ({', '.join(sorted(blind[what]))}); nodes share no disk: "
                f"use a bucket, e.g. {shown}=s3://BUCKET/{'runs' if what == 'output_dir' else 'data'}"
            )


def _nodes_missing(nodes: list[dict], paths: dict[str, str]) -> dict[str, list[str]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def which_exist(candidates: dict[str, str]) -> dict[str, bool]:
        return {what: os.path.exists(path) for what, path in candidates.items()}

    pending = {
        which_exist.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(paths): n["NodeManagerAddress"] + ":" + n["NodeID"][:8]
        for n in nodes
    }
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=60)
    blind: dict[str, list[str]] = {}
    for ref in ready:
        try:
            seen = ray.get(ref)
        except Exception:  # a node that went away meanwhile: nothing to say about it
            continue
        for what, exists in seen.items():
            if not exists:
                blind.setdefault(what, []).append(pending[ref])
    return blind


def check_worker_sees(run_dir_location: str, data_dir: str, output_dir: str) -> None:
    """In a worker: the run's local folders must be visible on this node (see
    `check_nodes_see`; this catches nodes that joined after the run started)."""
    check_visible(
        [
            ("output_dir", output_dir, Path(run_dir_location, CONFIG_FILE)),
            ("data.cache_dir", data_dir, Path(data_dir, MANIFEST_FILE)),
        ]
    )


def check_visible(checks: list[tuple[str, str, Path]]) -> None:
    """In a worker: each (setting, folder, a file the folder holds) must be readable here
    when the folder is local."""
    for what, folder, witness in checks:
        if not is_uri(folder) and not witness.exists():
            raise UserError(
                f"{what} {folder} is a local folder this node cannot see; nodes share no disk: "
                f"use a bucket, e.g. {what}=s3://BUCKET/..."
            )
