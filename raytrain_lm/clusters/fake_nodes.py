"""The node provider of `raytrain-lm cluster up`: Ray's fake_multinode provider, except that
every fake node gets a temp dir of its own, as every machine of a real cluster has its own disk.

The autoscaler of a `cluster up` cluster loads this class (cluster/local.yaml names it) and
calls it to start and stop fake nodes: extra raylets on this machine that advertise the
resources of a node type, fake GPUs included.

Ray's provider starts every fake node in the head's temp dir, and nodes sharing one session dir
step on each other:
- each node runs a log monitor that publishes every log file in the shared logs dir, so every
  worker line and autoscaler event reached the driver once per node, and a node that started
  later replayed the autoscaler's log from its beginning;
- each node's runtime-env agent sets up a job's working dir by deleting and unpacking it again
  (`overwrite=True` in Ray 2.60), in the one shared place, so workers already running from it on
  another node lost their current directory; torch's MKL then dies on its first use with
  "Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import ray._private.ray_constants as ray_constants
from ray._private.node import Node
from ray._private.parameter import RayParams
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from raytrain_lm.clusters.autoscaling import NODE_DIRS_KEY


class FakeNodeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str):
        super().__init__(provider_config, cluster_name)
        if not self._gcs_address or NODE_DIRS_KEY not in provider_config:
            raise ValueError(
                f"{type(self).__name__} needs gcs_address and {NODE_DIRS_KEY} in its provider "
                "config; `raytrain-lm cluster up` sets both"
            )
        self._node_dirs = provider_config[NODE_DIRS_KEY]

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # Ray 2.60's FakeMultiNodeProvider method of the same name, with a temp dir per node.
        resources = copy.deepcopy(resources)
        with self.lock:
            node_type = tags[TAG_RAY_USER_NODE_TYPE]
            next_id = self._next_hex_node_id()
            ray_params = RayParams(
                min_worker_port=0,
                max_worker_port=0,
                dashboard_port=None,
                dashboard_agent_listen_port=0,
                num_cpus=resources.pop("CPU", 0),
                num_gpus=resources.pop("GPU", 0),
                object_store_memory=resources.pop("object_store_memory", None),
                resources=resources,
                labels=labels,
                redis_address=self._gcs_address,
                gcs_address=self._gcs_address,
                temp_dir=str(Path(self._node_dirs) / f"n{self._next_node_id}"),
                env_vars={
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": next_id,
                    "RAY_CLOUD_INSTANCE_ID": next_id,
                    "RAY_NODE_TYPE_NAME": node_type,
                    ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                    ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(labels),
                },
            )
            node = Node(ray_params, head=False, shutdown_at_exit=False, spawn_reaper=False)
            self._nodes[next_id] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                    TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: next_id,
                    TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                    **tags,
                },
                "node": node,
            }
