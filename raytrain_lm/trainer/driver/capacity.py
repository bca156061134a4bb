"""The cluster capacity Ray Train's elastic policy sizes a worker group by: draining nodes left
out, refreshed after a node loss or a spot notice.

Ray Train's elastic policy reads capacity from Ray Data's autoscaling coordinator, a detached
actor that counts every alive node and re-reads the cluster only every 20 s. Two things then
make a restart ask for workers it cannot place, and wait out `fault.worker_start_timeout_s`
(10 minutes by default) before Ray Train retries smaller:
- a node being drained for a spot preemption is alive until its deadline, but Ray places
  nothing new on it;
- a lost node is still listed until the coordinator's next look.
So the driver creates the coordinator itself, before Ray Data or Ray Train would, with a node
listing that leaves draining nodes out (`create_capacity_view`), and asks it to look again
right before a restart (`refresh_capacity_view`).

Internal Ray APIs (pinned Ray 2.60): if they move, both functions do nothing and Ray's own
timeout-and-retry path still recovers, only slower. A coordinator another job created first
keeps Ray's own node listing.
"""

from __future__ import annotations

import logging

from raytrain_lm.placement import schedulable_nodes

logger = logging.getLogger(__name__)

_REQUESTER = "raytrain-lm"


def _head_node_id() -> str:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def create_capacity_view() -> None:
    """Creates Ray Data's autoscaling coordinator with `schedulable_nodes` as its view of the
    cluster, unless one exists already. On the head node, which is never preempted: Ray would
    put it on the node of whoever asks first, a worker's when Ray Data runs inside Train."""
    try:
        import ray
        from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
            dac._AutoscalingCoordinatorActor
        ).options(
            name="AutoscalingCoordinator",
            namespace="AutoscalingCoordinator",
            get_if_exists=True,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
        )
        with dac._get_or_create_lock:
            actor.remote(get_cluster_nodes=schedulable_nodes)
    except Exception:  # best effort: never let bookkeeping stop a run
        logger.warning("could not set up the cluster capacity view", exc_info=True)


def refresh_capacity_view() -> None:
    """Has the coordinator re-read the cluster now (a lost node gone, a drained one left out)."""
    try:
        import ray
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote(_REQUESTER, recompute=True), timeout=10)
    except Exception:  # best effort: never let bookkeeping break recovery
        logger.warning("could not refresh the cluster capacity view", exc_info=True)
