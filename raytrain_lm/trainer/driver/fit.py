"""One TorchTrainer.fit() of a run: the worker group's placement, process groups, failure
budgets and callbacks (launch.py runs as many as the run needs)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

from raytrain_lm.config import RunConfig
from raytrain_lm.placement import (
    hand_over_on_demand,
    release_resource_requests,
    worker_resources,
)
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.rundir import RAY_TRAIN_SNAPSHOT, RunDir
from raytrain_lm.runtime import use_gpu
from raytrain_lm.trainer.components import stop_requests
from raytrain_lm.trainer.components.spot_first import ON_DEMAND, current_market
from raytrain_lm.trainer.driver.stopping import run_interruptibly
from raytrain_lm.trainer.spec import WorkerSpec


def fit(spec: WorkerSpec, callbacks: list | None = None) -> None:
    """One TorchTrainer.fit(): Ray Train retries failures within it, within the budgets."""
    from ray.train import CheckpointConfig, FailureConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.config import LoggingConfig

    from raytrain_lm.trainer.driver.callbacks import EndAfterReplicasDone, FailureEvents
    from raytrain_lm.trainer.driver.replica_placement import ReplaceWhenPlaceable
    from raytrain_lm.trainer.entry import train_loop_per_worker

    cfg, run_dir = spec.config, spec.run_dir
    fault = cfg.fault
    gpu = use_gpu(cfg.scaling)
    if cfg.scaling.capacity == "spot_first":
        spec = replace(spec, market=current_market(read_events(run_dir)))
    # Read by Ray Train's controller, which inherits them from this process.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(fault.worker_start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(fault.health_check_s)
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(fault.preemption_check_s)
    os.environ["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] = str(fault.collective_timeout_s)
    # Ray Train lists the checkpoints reported to it in a snapshot and refuses to start a run
    # whose listed checkpoints are gone, as those we prune are (or a PBT trial's superseded
    # ones). The loop restores the newest complete checkpoint on disk itself, so Ray's list
    # is not needed to resume.
    run_dir.delete(RAY_TRAIN_SNAPSHOT)
    trainer = TorchTrainer(
        lambda: train_loop_per_worker(spec),
        torch_config=_torch_config(cfg, gpu),
        scaling_config=_scaling(cfg, gpu, spec.market),
        run_config=RayRunConfig(
            name=cfg.name,
            storage_path=str(run_dir.parent),
            # We prune (last K plus the best by val loss): Ray's own keeps only top-K by one score.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            failure_config=FailureConfig(
                max_failures=fault.max_failures, max_preemption_failures=fault.max_preemptions
            ),
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[
                FailureEvents(str(run_dir), fault.node_loss_wait_s if cfg.scaling.elastic else 0.0),
                *(
                    [
                        EndAfterReplicasDone(str(run_dir), grace_s=10 * fault.health_check_s + 5),
                        ReplaceWhenPlaceable(str(run_dir)),
                    ]
                    if cfg.scaling.fault_tolerance == "replicas"
                    else []
                ),
                *(callbacks or []),
            ],
        ),
    )
    started = time.time()
    if spec.market == ON_DEMAND:  # this group's own request takes over the on-demand nodes
        threading.Thread(
            target=hand_over_on_demand,
            args=(cfg.name, trainer.train_run_context.run_id),
            daemon=True,
        ).start()
    try:
        run_interruptibly(trainer.fit)
    except Exception:
        done = _replicas_done_since(cfg, run_dir, started)
        if done is None:
            raise
        if not done.get("too_few"):  # too few: the caller says why the run ended
            print(
                "[raytrain-lm] the replica groups are done; Ray Train's controller, still "
                "waiting to replace a lost group, was ended",
                flush=True,
            )
    finally:
        # A run that ends cleanly has withdrawn its resource request already; one forced to
        # end (a second signal, a failure) would leave it to expire, and idle nodes with it.
        release_resource_requests(trainer.train_run_context.run_id)


def _replicas_done_since(cfg: RunConfig, run_dir: RunDir, started: float) -> dict | None:
    """The event of replica groups that ended this invocation themselves (their chief's),
    after which a failing fit() is only its controller ended (callbacks.EndAfterReplicasDone)."""
    if cfg.scaling.fault_tolerance != "replicas":
        return None
    done = [
        e
        for e in read_events(run_dir)
        if e["event"] == stop_requests.REPLICAS_DONE and e["t"] >= started
    ]
    return done[-1] if done else None


def _torch_config(cfg: RunConfig, gpu: bool):
    """Ray Train's process groups: one for the whole group (restart), or one per worker, each a
    replica group of its own with torchft's Lighthouse on the head (replicas)."""
    from ray.train.torch import TorchConfig

    backend = "nccl" if gpu else "gloo"
    timeout = int(cfg.fault.collective_timeout_s)
    if cfg.scaling.fault_tolerance == "replicas":
        from ray.train.v2.torch.torchft_config import TorchftConfig

        from raytrain_lm.trainer.groups.quorum import lighthouse_settings

        return TorchftConfig(lighthouse_settings(cfg), backend=backend, timeout_s=timeout)
    return TorchConfig(backend=backend, timeout_s=timeout)


def _scaling(cfg: RunConfig, gpu: bool, market: str):
    import ray
    from ray.train import ScalingConfig

    scaling = cfg.scaling
    placement = worker_resources(scaling, gpu, ray.cluster_resources(), market)
    # Replica groups: Ray Train keeps max_workers groups (it replaces a lost one alone, as
    # capacity allows); torchft's quorum trains on while at least min_workers take part.
    elastic = scaling.elastic and scaling.fault_tolerance == "restart"
    return ScalingConfig(
        num_workers=(scaling.min_size, scaling.max_size) if elastic else scaling.max_size,
        use_gpu=gpu,
        elastic_resize_monitor_interval_s=scaling.resize_check_s,
        **placement,
    )
