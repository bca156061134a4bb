"""`train_loop_per_worker`: what Ray Train runs in each worker (Ray's own pattern: restore
first, then step, then report). The one place a run's mode is chosen: the group from
`scaling.fault_tolerance`, the sync from `parallel.sync` (GROUPS, SYNCS), each built from its
own settings; the loop (worker.py) is the same for all.

With ray_side.py, the only module here that calls Ray Train's per-worker API; `raytrain-lm
eval`'s worker function is eval_entry.py.
"""

from __future__ import annotations

import logging
import time

import ray
import ray.train

from raytrain_lm.trainer.distributed.collectives import pin_gloo_interface
from raytrain_lm.trainer.groups.replicas import ReplicaGroup
from raytrain_lm.trainer.groups.static import StaticGroup
from raytrain_lm.trainer.ray_side import RaySide
from raytrain_lm.trainer.spec import WorkerSpec
from raytrain_lm.trainer.storage_checks import check_worker_sees
from raytrain_lm.trainer.syncs import SYNCS
from raytrain_lm.trainer.worker import Worker

GROUPS = {"restart": StaticGroup, "replicas": ReplicaGroup}


def train_loop_per_worker(spec: WorkerSpec) -> None:
    t_start = time.time()
    _quiet_ray_train_info_logs()
    context = ray.train.get_context()
    pin_gloo_interface(ray.util.get_node_ip_address())  # before any gloo group (the flags')
    check_worker_sees(str(spec.run_dir), spec.data_dir, spec.config.output_dir)
    cfg = spec.config
    side = RaySide(context.get_local_world_size())
    group = GROUPS[cfg.scaling.fault_tolerance](
        spec, side, context.get_world_rank(), context.get_world_size()
    )
    Worker(spec, side, group, SYNCS[cfg.parallel.sync], t_start).run()


def _quiet_ray_train_info_logs() -> None:
    # Ray Train logs every report and checkpoint at INFO from loggers named by file path,
    # which LoggingConfig does not reach; our progress line already says the same.
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)
