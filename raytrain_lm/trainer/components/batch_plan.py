"""How a configured global batch maps onto the current workers (recomputed at every start and
at every re-balance), where an invocation stops, and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_lm.config import TrainingConfig


@dataclass(frozen=True)
class BatchPlan:
    """Each rank's share of the global batch and how it splits into forward passes.

    Shares are equal unless `scaling.balance` weights them by speed
    (trainer/components/balance.py). The step's gradient is the mean over the global batch's
    tokens whatever the shares, because each forward pass's loss is weighted by its part of the
    global batch (step.py).
    """

    world_size: int
    global_batch: int  # sequences per optimizer step, all workers together
    shares: tuple[int, ...]  # sequences per step of each rank, summing to global_batch
    passes: tuple[int, ...]  # forward passes per step of each rank

    @classmethod
    def derive(
        cls,
        cfg: TrainingConfig,
        world_size: int,
        weights: Sequence[float] | None = None,
        same_passes: bool = False,
    ) -> BatchPlan:
        """Equal shares (None), or shares in proportion to `weights`. `same_passes`: every
        rank makes as many forward passes (FSDP, where each backward is a collective)."""
        g = cfg.global_batch_size
        shares = split_by_weight(g, weights or [1.0] * world_size)
        # Equal shares split evenly: RunConfig refuses a global batch that some allowed world
        # size cannot split (config/run.py) unless the run balances its shares.
        assert weights is not None or len(set(shares)) == 1, (g, world_size)
        # Unset: passes as large as the equal split's, so that a fast rank's larger share
        # takes more passes rather than more activation memory than the run was sized for.
        micro = cfg.micro_batch_size or -(-g // world_size)
        passes = [-(-share // micro) for share in shares]
        if same_passes:
            passes = [max(passes)] * world_size
        return cls(world_size, g, shares, tuple(passes))

    @property
    def micro_batch(self) -> int:
        """The most sequences any rank puts through one forward pass."""
        return max(-(-s // p) for s, p in zip(self.shares, self.passes, strict=True))

    @property
    def accumulation(self) -> int:
        """The most forward passes any rank makes per step."""
        return max(self.passes)

    @property
    def balanced(self) -> bool:
        return len(set(self.shares)) > 1

    def offset(self, rank: int) -> int:
        """Where rank's slice starts within each global batch."""
        return sum(self.shares[:rank])

    def pass_sizes(self, rank: int) -> list[int]:
        """Sequences in each of rank's forward passes, as even as whole sequences allow. A 0
        is a pass that only keeps the ranks' collectives in step (FSDP, a tiny share)."""
        share, passes = self.shares[rank], self.passes[rank]
        return [share // passes + (1 if i < share % passes else 0) for i in range(passes)]

    def describe(self) -> str:
        if not self.balanced:
            return (
                f"micro-batch {self.micro_batch}, accumulation {self.accumulation}, global "
                f"batch {self.global_batch}"
            )
        shares, passes = list(self.shares), list(self.passes)
        return f"shares {shares} of global batch {self.global_batch}, passes {passes}"


def split_by_weight(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """`total` whole sequences in proportion to `weights`, at least one each (largest
    remainder, ties to the lower rank, so every rank computes the same split)."""
    n = len(weights)
    if total < n:
        raise ValueError(f"{total} sequences cannot give each of {n} ranks one")
    weight_sum = sum(weights)
    exact = [total * w / weight_sum for w in weights]
    shares = [max(1, math.floor(x)) for x in exact]
    # A rank with no sequences would have no loss to weight, hence the floor of one. Rounding
    # leaves sequences over (to the ranks furthest below their exact share) or, after that
    # floor, too many (from the ranks furthest above theirs); ties go to the lower rank.
    while sum(shares) < total:
        shares[max(range(n), key=lambda r: (exact[r] - shares[r], -r))] += 1
    while sum(shares) > total:
        over = [r for r in range(n) if shares[r] > 1]
        shares[max(over, key=lambda r: (shares[r] - exact[r], -r))] -= 1
    return tuple(shares)


def end_step(cfg: TrainingConfig) -> int:
    """The step this invocation trains to: max_steps, or stop_after_step if that is sooner."""
    return min(cfg.max_steps, cfg.stop_after_step or cfg.max_steps)


def learning_rate(step: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup then cosine decay to min_lr (nanoGPT's get_lr, exactly).

    Keyed to the optimizer step, which counts a fixed number of tokens (the global batch never
    changes with the world size), so the schedule is a function of tokens consumed.
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)


def share_metrics(plan: BatchPlan) -> dict[str, float]:
    """Each rank's share of the global batch, as the tracker logs it."""
    return {f"plan/rank{r}_share": float(n) for r, n in enumerate(plan.shares)}
