"""Shared fixtures: one local Ray for the whole session, tiny configs, a tiny corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import s3_server

from raytrain_lm.clusters.multinode import TINY_MODEL

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RUST_LOG", "warn")  # as raytrain_lm's API sets before its Ray starts
# Before any Ray starts, so that its workers can reach the test bucket server (see s3_server).
s3_server.export_credentials()

TINY = [
    *TINY_MODEL,
    "training.global_batch_size=8",
    "training.eval_sequences=64",
    "optim.warmup_steps=2",
    # Ray Train's controller acts on what it sees when it polls its workers: every start,
    # checkpoint and end of a tiny run waits for the next poll (Ray's default is every 2 s).
    "fault.health_check_s=0.25",
]


@pytest.fixture(scope="session", autouse=True)
def ray_session(request):
    """One Ray for the session, started before anything else can start a smaller one
    (`prepare` starts a local Ray when none runs); logical CPUs cover 4 workers plus Ray Data.
    A session of only chaos and own_ray tests needs none (those start their own Rays), nor one
    of no_ray tests (`make test-fast`)."""
    import ray

    if all(
        any(item.get_closest_marker(m) for m in ("chaos", "own_ray", "no_ray"))
        for item in request.session.items
    ):
        yield None
        return
    if not ray.is_initialized():
        # A Ray of its own (never another one on this machine) that names its API server,
        # as `raytrain-lm` starts one: see runtime.init_local_ray.
        from raytrain_lm.runtime import init_local_ray

        init_local_ray(num_cpus=6, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shared")
    return {"data": root / "data", "mlflow": root / "mlflow.db"}


def shared_run_overrides(output_dir: Path, shared_dirs: dict[str, Path]) -> list[str]:
    """Tiny-model overrides writing runs under output_dir, sharing the session's prepared data
    and MLflow store."""
    return [
        *TINY,
        f"output_dir={output_dir}",
        f"data.cache_dir={shared_dirs['data']}",
        f"tracking.uri=sqlite:///{shared_dirs['mlflow']}",
    ]


@pytest.fixture
def tiny_overrides(tmp_path, shared_dirs) -> list[str]:
    """Tiny-model overrides writing runs under tmp_path, sharing prepared data and MLflow."""
    return shared_run_overrides(tmp_path / "runs", shared_dirs)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real MLflow tracking server (sqlite backend, 127.0.0.1) for the session: starting
    one takes long on a busy machine. A test that stops it starts it again."""
    from support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3():
    """The session's S3-protocol server (moto on 127.0.0.1); `s3.new_bucket()` for a bucket."""
    server = s3_server.S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def learned_run(ray_session, tmp_path_factory, shared_dirs) -> dict:
    """One tracked 2-worker run, 40 steps (val loss and a checkpoint at steps 20 and 40), that
    the tests reading a finished run back share instead of each training its own. Its run
    directory is `output_dir / "learns"`; tests must not change it (copy it first). It is the
    suite's llama run (grouped-query attention, untied output projection), sharded with FSDP:
    its checkpoints are DCP shards, the last with the whole weights gathered. The others train
    the default gpt2 under DDP. It counts its workers' reads of device values (`count-syncs`).
    """
    import raytrain_lm
    from raytrain_lm.config import load_config

    output_dir = tmp_path_factory.mktemp("learned") / "runs"
    overrides = [
        *shared_run_overrides(output_dir, shared_dirs),
        "name=learns",
        "model.arch=llama",
        "model.n_kv_head=1",
        "model.tie_embeddings=false",
        "parallel.strategy=fsdp",
        "training.max_steps=40",
        "training.eval_every=20",
        "checkpoint.every_steps=20",
        "optim.lr=3e-3",
    ]
    # Counting the host's reads of device values changes nothing else (trainer/chaos.py).
    from raytrain_lm.trainer.chaos import ENV_VAR

    os.environ[ENV_VAR] = "count-syncs"
    try:
        summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    finally:
        del os.environ[ENV_VAR]
    return {"summary": summary, "overrides": overrides, "output_dir": output_dir}


STEPS, BATCH = 12, 12  # the world-size runs: a global batch every world size from 1 to 4 divides


@pytest.fixture(scope="session")
def world_size_runs(ray_session, tmp_path_factory, shared_dirs) -> dict:
    """The settings the world-size tests share, and an uninterrupted 2-worker DDP run of them
    (2 workers x 6 accumulation steps of 1 sequence) that they compare against; it is also the
    suite's trained gpt2 run that export reads (test_export.py)."""
    import raytrain_lm
    from raytrain_lm.config import load_config

    output_dir = tmp_path_factory.mktemp("world-sizes") / "runs"
    common = [
        *shared_run_overrides(output_dir, shared_dirs),
        f"training.global_batch_size={BATCH}",
        "training.micro_batch_size=1",
        f"training.max_steps={STEPS}",
        f"training.eval_every={STEPS}",
        "checkpoint.every_steps=3",
        "training.ledger=true",
        "training.precision=fp32",
        "optim.lr=3e-3",
        "data.shuffle_window_shards=1",
        # 4 sharded workers then evaluate 16, 16, 16 and 15: the last pads its forward passes
        # (each is a collective) and its sums still count 63
        "training.eval_sequences=63",
    ]
    overrides = [*common, "name=uninterrupted", "scaling.num_workers=2"]
    reference = raytrain_lm.train(load_config(None, overrides), sample=False)
    return {"common": common, "reference": reference, "output_dir": output_dir}


@pytest.fixture(scope="session")
def plain_diloco_run(world_size_runs) -> dict:
    """Two replica groups on the world-size runs' settings, syncing by DiLoCo every 4 steps with
    a plain outer step (outer lr 1, no momentum). LocalSGD must train its steps
    (test_local_sgd.py), and test_diloco.py checks its rounds, ledger, checkpoints and bytes,
    none of which the outer optimizer changes: one run serves both."""
    import raytrain_lm
    from raytrain_lm.config import load_config

    overrides = [
        *world_size_runs["common"],
        "name=diloco-plain",
        "scaling.fault_tolerance=replicas",
        "scaling.num_workers=2",
        "parallel.sync=diloco",
        "diloco.sync_every=4",
        "diloco.outer_lr=1",
        "diloco.outer_momentum=0",
    ]
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    return {"summary": summary, "run_dir": world_size_runs["output_dir"] / "diloco-plain"}
