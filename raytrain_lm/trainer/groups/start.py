"""What the chief of a worker group records as the group starts: the previous group's end, this
segment's start (events goodput and cost are counted from), and the run-wide checks that read
the events so far (the budget, the interruption rate for the checkpoint interval)."""

from __future__ import annotations

import time

from raytrain_lm.data import ledger
from raytrain_lm.run_events.journal import close_previous_segment
from raytrain_lm.trainer.checkpointing.checkpoint_interval import observed_interruptions
from raytrain_lm.trainer.components.batch_plan import share_metrics
from raytrain_lm.trainer.components.budget import BudgetGuard
from raytrain_lm.trainer.components.parts import LoopParts
from raytrain_lm.trainer.progress import announce


def record_start(
    parts: LoopParts, nodes: list[str], world_size: int, price: float, guard: bool = True
):
    """Returns the budget guard (with budget.* set and `guard`: replica groups keep their
    account in chief_stops.py) and the run's interruptions so far (rate per second, recovery
    seconds; for checkpoint.every_steps=auto)."""
    cfg, run_dir, state = parts.cfg, parts.run_dir, parts.progress.state
    plan = parts.trainee.plan
    if cfg.training.ledger:
        ledger.discard_after(run_dir, state.step)
    close_previous_segment(run_dir)
    budget = None
    if guard and (cfg.budget.max_usd or cfg.budget.deadline):
        budget = BudgetGuard(cfg.budget, run_dir, parts.end_step)
    interruptions = (0.0, 0.0)
    if cfg.checkpoint.every_steps == "auto":
        interruptions = observed_interruptions(run_dir)
    parts.journal.start_heartbeats()
    parts.journal.keep(
        "segment_start",
        segment=parts.journal.segment,
        t_start=parts.journal.t_start,
        t_restored=time.time(),
        restored_step=state.step,
        world_size=world_size,
        layout=parts.trainee.layout.describe(),
        accumulation=plan.accumulation,
        shares=list(plan.shares),
        types=parts.trainee.where.types,
        price_per_hour=price,
        nodes=nodes,  # lets a failure tell a lost node
    )
    origin = f"resumed at step {state.step} ({state.tokens:,} tokens)"
    announce(f"{origin if state.step else 'started'}; world size {world_size}, " + plan.describe())
    return budget, interruptions


def start_metrics(parts: LoopParts) -> dict[str, float]:
    plan = parts.trainee.plan
    return {"world_size": plan.world_size, "accumulation_steps": plan.accumulation} | share_metrics(
        plan
    )
