"""Runs a `tests/support` module as a job of gloo ranks outside Ray, the way torchrun would:
one process per rank, with torchrun's environment variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from raytrain_lm.runtime import free_port

TESTS = Path(__file__).resolve().parents[1]


def run_ranks(module: str, out: Path, world: int, timeout_s: float = 300) -> dict:
    """`python -m support.<module> OUT` on `world` ranks; returns what rank 0 wrote to
    OUT/rank0.json, with "out" added. One thread per rank: the ranks share 2 cores."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", f"support.{module}", str(out)],
            cwd=TESTS,
            env={**env, "RANK": str(rank)},
        )
        for rank in range(world)
    ]
    assert [p.wait(timeout=timeout_s) for p in ranks] == [0] * world
    return {"out": out, **json.loads((out / "rank0.json").read_text())}
