"""The `replicas` section: the timings of replica groups (`scaling.fault_tolerance=replicas`,
trainer/groups/replicas.py), which keep stepping while a group is lost, replaced or drained; and the
`diloco` section: how they train over slow links with `parallel.sync=diloco` (trainer/syncs/diloco.py).
"""

from __future__ import annotations

from pydantic import Field

from raytrain_lm.config.base import _Section


class ReplicasConfig(_Section):
    heartbeat_timeout_s: float = Field(
        2.0,
        gt=0.0,
        description="a group silent this long is left out of the next step's quorum",
    )
    join_timeout_s: float = Field(
        2.0,
        ge=0.0,
        description="how long a quorum that lacks a group of the last one waits for known "
        "groups that have not asked yet before it goes on with those that did (at least "
        "scaling.min_workers): what the others stall when a group is lost",
    )
    quorum_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="how long one attempt at a quorum waits before the group checks that "
        "the Lighthouse answers and asks again (until replicas.min_workers_wait_s)",
    )
    timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="a collective, commit vote or healing transfer waiting longer fails "
        "(the step is taken again by the next quorum)",
    )
    min_workers_wait_s: float = Field(
        600.0,
        gt=0.0,
        description="how long the run waits for scaling.min_workers groups (capacity lost) "
        "before it ends, saying why",
    )


class DilocoConfig(_Section):
    sync_every: int = Field(
        32,
        ge=1,
        description="H: inner steps each replica group takes alone between two outer syncs",
    )
    outer_lr: float = Field(0.7, gt=0.0, description="the outer optimizer's learning rate")
    outer_momentum: float = Field(
        0.9, ge=0.0, lt=1.0, description="the outer optimizer's Nesterov momentum (0: plain SGD)"
    )
    fragments: int = Field(
        1, ge=1, description="Streaming DiLoCo's model fragments, synced in turn (1: DiLoCo)"
    )
    full_sync_every: int = Field(
        4,
        ge=1,
        description="with fragments > 1: rounds between two syncs of every fragment at once, "
        "the points a run commits at (a group lost in between costs up to this many rounds)",
    )
    join_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="how long a sync waits for live groups still in their round (a slower "
        "group) before it goes on without them, and the round is taken again",
    )
    quantize: bool = Field(
        False,
        description="the outer all-reduce in fp8 (torchft's fused kernels: CUDA with Triton)",
    )
