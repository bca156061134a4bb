"""Where a run's workers may go: resources and selectors from `scaling`, nothing else.

Nodes say what they are through Ray resources: `accelerator_type:<TYPE>` (Ray adds it on GPU
nodes; cluster configs set it on fake nodes) and `spot` or `on_demand` (set by our cluster
configs). A worker asking for a tiny amount of such a resource can only land on such a node.
"""

from __future__ import annotations

from typing import Any

from raytrain_lm.config import ScalingConfig

MARKER_AMOUNT = 0.001  # asks for a node kind without using up its capacity


def accelerator_types(scaling: ScalingConfig) -> list[str]:
    if scaling.accelerator_type is None:
        return []
    if isinstance(scaling.accelerator_type, str):
        return [scaling.accelerator_type]
    return list(scaling.accelerator_type)


def choose_accelerator(types: list[str], cluster_resources: dict[str, float]) -> str:
    """One type for the whole DDP group: the listed type with the most GPUs up now, else the
    first listed (an autoscaler then launches nodes of that type)."""
    present = {t: cluster_resources.get(f"accelerator_type:{t}", 0.0) for t in types}
    best = max(types, key=lambda t: present[t])
    return best if present[best] > 0 else types[0]


def worker_resources(
    scaling: ScalingConfig, gpu: bool, cluster_resources: dict[str, float]
) -> dict[str, Any]:
    """Keyword arguments for Ray Train's ScalingConfig beyond the worker counts."""
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker, **scaling.worker_resources}
    if gpu:
        resources["GPU"] = scaling.gpus_per_worker
    if scaling.capacity != "any":
        resources[scaling.capacity] = MARKER_AMOUNT
    extra: dict[str, Any] = {}
    types = accelerator_types(scaling)
    if types and (len(types) == 1 or not scaling.allow_mixed_accelerators):
        chosen = choose_accelerator(types, cluster_resources)
        resources[f"accelerator_type:{chosen}"] = MARKER_AMOUNT
    elif types:
        extra["label_selector"] = {"ray.io/accelerator-type": f"in({','.join(types)})"}
    return {"resources_per_worker": resources, **extra}
