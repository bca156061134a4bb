"""Restoring with a slow rank 0 (trainer/checkpointing/restore.py) and the interface gloo binds to
(collectives.pin_gloo_interface), on 2 gloo ranks outside Ray: support/restore_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.restore_check import COLLECTIVE_TIMEOUT_S, SLOW_S, STEP

from raytrain_lm.runtime import free_port
from raytrain_lm.trainer.distributed.collectives import (
    GLOO_INTERFACE_ENV,
    gloo_interface_for,
    pin_gloo_interface,
)

TESTS = Path(__file__).resolve().parent


def _two_ranks(mode: str, tmp_path: Path) -> list[dict]:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != GLOO_INTERFACE_ENV}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    command = [sys.executable, "-m", "support.restore_check", mode, str(run_dir), str(out)]
    ranks = [
        subprocess.Popen(command, cwd=TESTS, env={**env, "RANK": str(rank)}) for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_slow_rank_0_is_waited_for_beyond_the_collective_timeout(tmp_path):
    """Rank 0 takes longer to choose than the training group's collective timeout allows:
    both ranks restore its choice, and the training group works on."""
    seen = _two_ranks("restore", tmp_path)
    for rank in seen:
        assert rank["interface"] == "lo"
        assert rank["location"] == f"checkpoint_{STEP:06d}" and rank["step"] == STEP
        assert rank["weights_restored"] and rank["group_after"] == 2.0
    # Rank 1 waited about SLOW_S (less the moment it took to see the checkpoint written),
    # well past the timeout that would have failed the training group.
    assert seen[1]["waited_s"] > COLLECTIVE_TIMEOUT_S + 1 and SLOW_S > COLLECTIVE_TIMEOUT_S + 2


def test_the_default_group_would_time_out_waiting_for_rank_0(tmp_path):
    """The protocol restore_group replaced, in the same setting: the choice broadcast in the
    training group times out on rank 1 (on NCCL, the watchdog then aborts the process)."""
    seen = _two_ranks("default-group", tmp_path)
    assert "error" in seen[1] and "received" not in seen[1], seen[1]
    assert seen[1]["waited_s"] < SLOW_S


def test_gloo_binds_to_the_interface_holding_the_node_address(monkeypatch):
    """Not the hostname's address (127.0.1.1 on many images), which no other node can reach."""
    assert gloo_interface_for("127.0.0.1") == "lo"
    assert gloo_interface_for("203.0.113.9") is None  # on no interface here
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert pin_gloo_interface("203.0.113.9") is None and GLOO_INTERFACE_ENV not in os.environ
    assert pin_gloo_interface("127.0.0.1") == "lo" == os.environ[GLOO_INTERFACE_ENV]
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")  # the user's choice stands
    assert pin_gloo_interface("127.0.0.1") == "eth7"


@pytest.fixture(autouse=True)
def _restore_gloo_environment(monkeypatch):
    monkeypatch.setenv(GLOO_INTERFACE_ENV, os.environ.get(GLOO_INTERFACE_ENV, ""))
