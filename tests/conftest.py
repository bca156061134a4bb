"""Shared fixtures: one local Ray for the whole session, tiny configs, a tiny corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.sources=builtin:python-docs",
    "data.max_source_bytes=300000",
    "training.global_batch_size=8",
    "training.eval_sequences=64",
    "training.progress=false",
    "training.sample_tokens=0",
    "optim.warmup_steps=2",
]


@pytest.fixture(scope="session", autouse=True)
def ray_session(request):
    """One Ray for the session, started before anything else can start a smaller one
    (`prepare` starts a local Ray when none runs); logical CPUs cover 4 workers plus Ray Data.
    A session of chaos tests only starts its own multi-node Ray instead."""
    import ray

    if all(item.get_closest_marker("chaos") for item in request.session.items):
        yield None
        return
    if not ray.is_initialized():
        # address="local": never join another Ray that happens to run on this machine
        ray.init(address="local", num_cpus=6, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shared")
    return {"data": root / "data", "mlflow": root / "mlflow.db"}


@pytest.fixture
def tiny_overrides(tmp_path, shared_dirs) -> list[str]:
    """Tiny-model overrides writing runs under tmp_path, sharing prepared data and MLflow."""
    return [
        *TINY,
        f"output_dir={tmp_path / 'runs'}",
        f"data.cache_dir={shared_dirs['data']}",
        f"tracking.uri=sqlite:///{shared_dirs['mlflow']}",
    ]
