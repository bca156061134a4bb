"""Where a run's workers may go: resources and selectors from `scaling`, nothing else.

Nodes say what they are through Ray resources: `accelerator_type:<TYPE>` (Ray adds it on GPU
nodes; cluster configs set it on fake nodes) and `spot` or `on_demand` (set by our cluster
configs). A worker asking for a tiny amount of such a resource can only land on such a node,
and the autoscaler (v1 and v2) launches a node type that has it.

Mixing accelerator types in one DDP group goes through a label selector instead, since
resources cannot say "A100 or H100": `ray.io/accelerator-type` is a label Ray sets by itself on
every GPU node. Only autoscaler v2 (KubeRay with autoscaler v2, or RAY_enable_autoscaler_v2=1)
launches nodes for label selectors; with v1 a mixed run uses the GPU nodes already up.
"""

from __future__ import annotations

from typing import Any

from raytrain_lm.config import ScalingConfig

MARKER_AMOUNT = 0.001  # asks for a node kind without using up its capacity
ACCELERATOR_LABEL = "ray.io/accelerator-type"


def accelerator_types(scaling: ScalingConfig) -> list[str]:
    if scaling.accelerator_type is None:
        return []
    if isinstance(scaling.accelerator_type, str):
        return [scaling.accelerator_type]
    return list(scaling.accelerator_type)


def choose_accelerator(types: list[str], cluster_resources: dict[str, float]) -> str:
    """One type for the whole DDP group: the listed type with the most nodes up now (each node
    carries 1 of its `accelerator_type:` resource), else the first listed, whose nodes an
    autoscaler then launches."""
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
        extra["label_selector"] = {ACCELERATOR_LABEL: f"in({','.join(types)})"}
    if scaling.label_selector:
        extra["label_selector"] = {**extra.get("label_selector", {}), **scaling.label_selector}
    return {"resources_per_worker": resources, **extra}


def keep_gpu_nodes_releasable() -> None:
    """Creates Ray Data's cluster-lifetime actor location tracker from the driver.

    Ray Data makes it (a detached actor) on the node of the first Ray Data execution. Ours run
    inside Train workers, so it would sit on a GPU node, which then is never idle and never
    scales down (seen on the fake cluster: the A100 node stayed until the tracker was killed).
    Made here first, it stays on the driver's node (the head); later lookups find it.
    """
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray.data._internal.execution.node_trackers import (
            get_or_create_actor_location_tracker,
        )
    except ImportError:  # a Ray without the tracker has nothing to pin
        return
    get_or_create_actor_location_tracker()
