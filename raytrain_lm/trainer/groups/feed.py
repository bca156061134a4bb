"""The training data stream of one worker: its slice of every step from a given one on,
through Ray Data (data/stream.py), in the run's global order (data/order.py)."""

from __future__ import annotations

from raytrain_lm.data.order import SequenceOrder
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches
from raytrain_lm.trainer.components.parts import LoopParts


def sequence_order(parts: LoopParts) -> SequenceOrder:
    """The run's global order of training sequences (the same in every worker)."""
    cfg, manifest = parts.cfg, parts.trainee.manifest
    return SequenceOrder(
        [s.tokens for s in manifest.splits["train"].shards],
        cfg.model.block_size,
        cfg.data.seed,
        cfg.data.shuffle_window_shards,
    )


def open_stream(parts: LoopParts, part: WorkerSlice, step: int | None = None):
    """`part` of every step from `step` (the current one if None) to the run's end."""
    return stream_train_batches(
        parts.spec.data_dir,
        parts.trainee.manifest,
        sequence_order(parts),
        part,
        part.per_rank,
        parts.progress.step if step is None else step,
        parts.end_step,
        read_cpus=parts.spec.read_cpus,
    )
