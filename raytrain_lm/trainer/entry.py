"""`train_loop_per_worker`: what Ray Train runs in each worker (Ray's own pattern: restore
first, then step, then report).

With ray_side.py (`RaySide`, everything else a worker asks of Ray), the only module that calls
Ray Train's per-worker API (`ray.train.get_context`, `get_checkpoint`, `report`,
`get_preemption_info`, `ray.train.torch.get_device`), beside `eval_entry.py`, the worker
function of `raytrain-lm eval` (context and device only). The loop itself is worker.py, plain
PyTorch and files.
"""

from __future__ import annotations

import logging
import time

import ray
import ray.train
import ray.train.torch

from raytrain_lm.trainer.distributed.collectives import pin_gloo_interface
from raytrain_lm.trainer.ray_side import RaySide
from raytrain_lm.trainer.spec import WorkerSpec
from raytrain_lm.trainer.storage_checks import check_worker_sees


def train_loop_per_worker(spec: WorkerSpec) -> None:
    t_start = time.time()
    _quiet_ray_train_info_logs()
    context = ray.train.get_context()
    pin_gloo_interface(ray.util.get_node_ip_address())  # before any gloo group (the flags')
    check_worker_sees(str(spec.run_dir), spec.data_dir, spec.config.output_dir)
    if spec.config.parallel.sync == "diloco":
        from raytrain_lm.trainer.syncs.diloco import DilocoWorker as Worker
    elif spec.config.scaling.fault_tolerance == "replicas":
        from raytrain_lm.trainer.groups.replicas import ReplicaWorker as Worker
    else:
        from raytrain_lm.trainer.worker import Worker
    side = RaySide(context.get_local_world_size())
    worker = Worker(spec, side, context.get_world_rank(), context.get_world_size(), t_start)
    worker.restore(ray.train.get_checkpoint())
    worker.start()
    worker.train()


def _quiet_ray_train_info_logs() -> None:
    # Ray Train logs every report and checkpoint at INFO from loggers named by file path,
    # which LoggingConfig does not reach; our progress line already says the same.
    from ray.train.v2._internal.execution import context, storage

    for module in (context, storage):
        logging.getLogger(module.__file__).setLevel(logging.WARNING)
        logging.getLogger(module.__name__).setLevel(logging.WARNING)
