"""Where a run's workers may go: resources and selectors from `scaling`, nothing else; and
withdrawing what a run asked the autoscaler for once it is over.

Nodes say what they are through Ray resources: `accelerator_type:<TYPE>` (Ray adds it on GPU
nodes; cluster configs set it on fake nodes), `cpu_node` (our cluster configs' worker types
without GPUs) and `spot` or `on_demand` (set by our cluster configs). A worker asking for a
tiny amount of such a resource can only land on such a node, and the autoscaler (v1 and v2)
launches a node type that has it. Workers of a run that names no GPU type and uses no GPU ask
for `cpu_node` where the cluster has such nodes, so they never take (or make the autoscaler
launch) a GPU node, nor the head.

Mixing accelerator types in one DDP group goes through a label selector instead, since
resources cannot say "A100 or H100": `ray.io/accelerator-type` is a label Ray sets by itself on
every GPU node. Only autoscaler v2 (KubeRay with autoscaler v2, or RAY_enable_autoscaler_v2=1)
launches nodes for label selectors; with v1 a mixed run uses the GPU nodes already up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from raytrain_lm.config import ScalingConfig

logger = logging.getLogger(__name__)


def schedulable_nodes() -> list[dict[str, Any]]:
    """`ray.nodes()` without the nodes being drained: Ray schedules nothing new on them."""
    import ray
    from ray._private.state import state

    draining = set(state.get_draining_nodes())
    return [n for n in ray.nodes() if n["NodeID"] not in draining]


MARKER_AMOUNT = 0.001  # asks for a node kind without using up its capacity
ACCELERATOR_LABEL = "ray.io/accelerator-type"
CPU_NODE = "cpu_node"
# "1" in the environment of a cluster's head when its worker types include `cpu_node` ones; our
# cluster configs set it, and job drivers on the head inherit it. A cluster scaled to zero shows
# no such node, and the v1 autoscaler (`ray up`) publishes no node types, so nothing else tells.
CPU_NODES_ENV = "RAYTRAIN_LM_CPU_NODES"
COORDINATOR = "AutoscalingCoordinator"  # Ray Data's actor, and its namespace


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


def offers_cpu_nodes(cluster_resources: dict[str, float]) -> bool:
    return os.environ.get(CPU_NODES_ENV) == "1" or cluster_resources.get(CPU_NODE, 0.0) > 0


def worker_resources(
    scaling: ScalingConfig, gpu: bool, cluster_resources: dict[str, float], market: str = "spot"
) -> dict[str, Any]:
    """Keyword arguments for Ray Train's ScalingConfig beyond the worker counts. `market`:
    under scaling.capacity=spot_first, `spot`, or `on_demand` for spot and on-demand nodes
    alike (trainer/components/spot_first.py)."""
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker, **scaling.worker_resources}
    if gpu:
        resources["GPU"] = scaling.gpus_per_worker
    capacity = scaling.capacity
    if capacity == "spot_first":
        capacity = "spot" if market == "spot" else "any"
    if capacity != "any":
        resources[capacity] = MARKER_AMOUNT
    extra: dict[str, Any] = {}
    types = accelerator_types(scaling)
    if types and (len(types) == 1 or not scaling.allow_mixed_accelerators):
        chosen = choose_accelerator(types, cluster_resources)
        resources[f"accelerator_type:{chosen}"] = MARKER_AMOUNT
    elif types:
        extra["label_selector"] = {ACCELERATOR_LABEL: f"in({','.join(types)})"}
    elif not gpu and offers_cpu_nodes(cluster_resources):
        resources[CPU_NODE] = MARKER_AMOUNT
    if scaling.label_selector:
        extra["label_selector"] = {**extra.get("label_selector", {}), **scaling.label_selector}
    return {"resources_per_worker": resources, **extra}


def pin_ray_data_actors_here() -> None:
    """Creates Ray Data's two cluster-lifetime actors from this process (a driver, on the head):
    its actor location tracker and its stats actor.

    Ray Data makes each (a detached actor) on the node of the first Ray Data execution. Ours
    run inside Train workers, so they would sit on a worker node:
    - the tracker keeps a GPU node from ever being idle, so it never scales down (seen on the
      fake cluster: the A100 node stayed until the tracker was killed);
    - the stats actor dies with a spot node, and the one made again knows none of the running
      pipelines: each of their metric updates fails with a KeyError that every worker prints
      (as CI's sweep notebook once printed, from a stats actor a Train worker had made; why
      that one was replaced is not known: a single node, nothing of ours kills it).
    Made here first, both stay on the driver's node; later lookups find them.
    """
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray.data._internal.execution.node_trackers import (
            get_or_create_actor_location_tracker,
        )
        from ray.data._internal.stats import get_or_create_stats_actor
    except ImportError:  # a Ray without them has nothing to pin
        return
    get_or_create_actor_location_tracker()
    get_or_create_stats_actor()


def release_resource_requests(run_id: str) -> None:
    """Withdraws what Ray Train run `run_id` asked the autoscaler for (no-op if nothing).

    Ray Train's controller registers its workers' resources with Ray Data's
    AutoscalingCoordinator (a detached actor), renews them every 20 s with a 180 s expiry, and
    withdraws them only when the controller shuts down or is aborted. A controller that dies
    with its driver (a stopped job's driver killed after its grace period, a signal the driver
    does not handle) never does: the coordinator keeps passing the request on to the autoscaler
    until it expires, and the worker nodes stay up about 3 minutes after the run. Call this
    when a run ends however it ended; `run_id` is `trainer.train_run_context.run_id` on the
    driver. Names are those of Ray 2.60 (data/_internal/cluster_autoscaler,
    train/v2/_internal/execution/scaling_policy).
    """
    withdraw_request(f"train-{run_id}")


class OnDemandRequests:
    """Run `run`'s request for on-demand nodes (scaling.capacity=spot_first, behind its
    deadline): `count` bundles of a worker's resources with the `on_demand` marker, asked of
    Ray's autoscaling coordinator beside Ray Train's own request, which the coordinator merges
    into what it asks the autoscaler for. Internal API (Ray 2.60's coordinator, as
    release_resource_requests): if it moves, asking fails with a warning and the run stays
    on spot."""

    EXPIRE_AFTER_S = 180.0  # renewed by the chief every 20 s while it is wanted

    def __init__(self, run: str, scaling: ScalingConfig, gpu: bool, accelerator: str):
        """`accelerator`: the group's type, which a run pinned to one type keeps."""
        import ray

        update: dict[str, Any] = {"capacity": "on_demand"}
        if accelerator in accelerator_types(scaling) and not scaling.allow_mixed_accelerators:
            update["accelerator_type"] = accelerator
        placement = worker_resources(
            scaling.model_copy(update=update), gpu, ray.cluster_resources()
        )
        self.requester = on_demand_requester(run)
        self.bundle = placement["resources_per_worker"]
        self.selector = placement.get("label_selector", {})

    def _coordinator(self):
        import ray

        # The driver made it (trainer/driver/capacity.py), on the head: never make one here.
        return ray.get_actor(COORDINATOR, namespace=COORDINATOR)

    def request(self, count: int) -> None:
        import ray

        try:
            ray.get(
                self._coordinator().request_resources.remote(
                    requester_id=self.requester,
                    resources=[dict(self.bundle) for _ in range(count)],
                    label_selectors=[dict(self.selector) for _ in range(count)],
                    expire_after_s=self.EXPIRE_AFTER_S,
                ),
                timeout=10,
            )
        except Exception:  # best effort: the run goes on with what it has
            logger.warning("could not ask for on-demand nodes", exc_info=True)

    def up(self) -> int:
        """How many such bundles fit on the on-demand nodes that are up and not being drained
        (by their total resources: nothing else of the run can use them while it is on spot)."""
        fits = 0
        for node in schedulable_nodes():
            total = node.get("Resources", {})
            wanted = node.get("Alive") and total.get("on_demand", 0) > 0
            if wanted and labels_match(node.get("Labels") or {}, self.selector):
                fits += min(int(total.get(k, 0.0) // v) for k, v in self.bundle.items() if v > 0)
        return fits

    def withdraw(self) -> None:
        withdraw_request(self.requester)


def labels_match(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node's labels satisfy a Ray label selector (`value`, `!value`, `in(a,b)`,
    `!in(a,b)`)."""
    for key, wanted in selector.items():
        negated = wanted.startswith("!")
        wanted = wanted.removeprefix("!")
        if wanted.startswith("in(") and wanted.endswith(")"):
            hit = labels.get(key) in {v.strip() for v in wanted[3:-1].split(",")}
        else:
            hit = labels.get(key) == wanted
        if hit == negated:
            return False
    return True


def on_demand_requester(run: str) -> str:
    return f"raytrain-lm-on-demand-{run}"


def hand_over_on_demand(run: str, train_run_id: str, timeout_s: float = 300.0) -> None:
    """Withdraws run `run`'s on-demand request once Ray Train run `train_run_id` (a group that
    may use those nodes) holds resources at the coordinator: the two together would ask the
    autoscaler for the on-demand nodes twice, and before it the nodes would be idle and
    unrequested, so leave. Runs in a thread beside `fit()`; gives up after `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            coordinator = ray.get_actor(COORDINATOR, namespace=COORDINATOR)
            held = ray.get(
                coordinator.get_reserved_resources.remote(f"train-{train_run_id}"), timeout=10
            )
        except Exception:  # not there yet, or busy: look again
            held = None
        if held:
            withdraw_request(on_demand_requester(run))
            return
        time.sleep(0.5)


@contextlib.contextmanager
def withdrawn_at_exit(run: str) -> Iterator[None]:
    """Withdraws run `run`'s on-demand request (if any) however the block ends."""
    try:
        yield
    finally:
        withdraw_request(on_demand_requester(run))


def withdraw_request(requester: str) -> None:
    """Withdraws `requester`'s request from Ray's autoscaling coordinator (no-op if none)."""
    import ray

    try:
        coordinator = ray.get_actor(COORDINATOR, namespace=COORDINATOR)
    except ValueError:  # nothing on this cluster ever asked the coordinator for resources
        return
    try:
        ray.get(coordinator.cancel_request.remote(requester), timeout=30)
    except Exception:  # best effort: the request still expires by itself
        logger.warning("could not withdraw %s's resource request", requester, exc_info=True)
