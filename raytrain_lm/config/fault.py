"""Surviving failures: restart budgets, timeouts and checkpoint retention, the settings a long
run on preemptible nodes tunes together.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raytrain_lm.config.base import _Section


class FaultConfig(_Section):
    max_failures: int = Field(
        3, ge=-1, description="restarts after worker/node failures (-1: unlimited)"
    )
    max_preemptions: int = Field(
        -1, ge=-1, description="restarts after spot preemptions, counted apart (-1: unlimited)"
    )
    worker_start_timeout_s: float = Field(
        600.0, gt=0.0, description="how long a worker group may take to start (GPU nodes boot)"
    )
    collective_timeout_s: float = Field(
        300.0, gt=0.0, description="a DDP collective waiting longer than this fails"
    )
    step_timeout_s: float = Field(
        900.0, gt=0.0, description="watchdog: a worker with no finished step for this long exits"
    )
    health_check_s: float = Field(2.0, gt=0.0, description="how often Ray Train polls workers")
    node_loss_wait_s: float = Field(
        10.0,
        ge=0.0,
        description="elastic runs: after a failure, wait this long for Ray to mark a lost node "
        "dead so the restart is sized for the nodes left (0: restart at once)",
    )
    preemption_check_s: float = Field(
        2.0, gt=0.0, description="how often the loop asks whether a node is being preempted"
    )
    stop_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="after a stop request (`raytrain-lm stop`, SIGTERM, Ctrl-C), how long the "
        "run may take to checkpoint at a step boundary before it is ended without one",
    )
    checkpoint_on_preemption: bool = Field(
        True, description="write a just-in-time checkpoint when a worker's node is drained"
    )
    price_per_hour: dict[str, float] = Field(
        default_factory=dict,
        description="price per worker-hour by accelerator type (or 'cpu'), for live cost; "
        "'A100:spot' or 'A100:on_demand' price a type by how its node is billed",
    )


class CheckpointConfig(_Section):
    every_steps: int | Literal["auto"] = Field(
        200,
        description="auto: after each checkpoint, the interval that minimises the expected "
        "time lost, from its measured save time and the run's interruptions (docs/cost.md)",
    )
    keep_last: int = Field(2, ge=1)

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: object) -> object:
        if value == "auto":
            return value
        try:
            steps = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            steps = 0
        if steps < 1 or steps != value:
            raise ValueError("a number of steps (at least 1) or auto")
        return steps

    keep_best: bool = Field(True, description="also keep the checkpoint with the best val loss")
    upload_retry_s: float = Field(
        600.0,
        gt=0,
        description="how long a checkpoint upload is retried while its bucket is unreachable "
        "before the worker group fails (and restarts from the previous complete checkpoint)",
    )
    restore_wait_s: float = Field(
        3600.0,
        gt=0,
        description="at a (re)start, how long the other workers wait while rank 0 finds the "
        "checkpoint to restore (it downloads and hashes every file of the newest ones)",
    )
