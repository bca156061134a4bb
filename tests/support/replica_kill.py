"""A replica-group run whose group 1 kills itself (a chaos fault the test sets): trained in the
background until Ray Train's replacement for that group has started, then at full speed to
its end (tests/test_diloco.py, tests/test_local_sgd.py)."""

from __future__ import annotations

from pathlib import Path

import raytrain_lm
from raytrain_lm.clusters.multinode import Background, wait_for_event
from raytrain_lm.config import load_config
from raytrain_lm.run_events.journal import read_events
from raytrain_lm.trainer import chaos


def train_until_group_1_replaced(run_dir: Path, overrides: list[str]) -> dict:
    """The run's summary, once group 1's second process started (waited for as an event, not
    a time) and the pacing stopped."""
    run = Background(lambda: raytrain_lm.train(load_config(None, overrides), sample=False))

    def group_1_replaced(event: dict) -> bool:
        """Group 1's second process started: on a loaded machine its first may already have
        healed, having joined after group 0's first sync."""
        if event["event"] != "replica_start" or event["group"] != 1:
            return False
        starts = [e for e in read_events(run_dir) if e["event"] == "replica_start"]
        return event["pid"] != next(e["pid"] for e in starts if e["group"] == 1)

    wait_for_event(run_dir, group_1_replaced, 300, still_running=run)
    chaos.stop_pacing(run_dir)
    return run.wait(600)
