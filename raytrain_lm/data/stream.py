"""Worker-side data: each Ray Train worker streams exactly its share of every global batch
through Ray Data, starting at the checkpointed position.

Global step s consumes positions [s*G, (s+1)*G) of the sequence order (G = global batch);
rank r takes the contiguous slice of its share n_r that starts after the lower ranks' shares
(n_r = G/W for equal shares; `scaling.balance` makes them uneven), and splits it into its
forward passes (step.py). Ray Data runs the reads as tasks (parallel, prefetched, bounded by
its streaming executor); the position arithmetic is ours, so a restart at any world size
resumes exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raytrain_lm.data.manifest import Manifest, read_shard
from raytrain_lm.data.order import SequenceOrder, validation_starts
from raytrain_lm.data.pipeline import ERROR_COLUMN, ordered_dataset
from raytrain_lm.errors import UserError

STEPS_PER_READ_TASK = 16


class ShardCache:
    """Keeps the most recently read shards of one split decoded in memory.

    Sequences are drawn at random from one shuffle window at a time, so the cache holds a
    whole window (`data.shuffle_window_shards` shards): memory is bounded by window x shard
    size, and each shard is read and checksummed once per window instead of once per batch.
    """

    def __init__(self, directory: str | Path, manifest: Manifest, split: str, capacity: int = 2):
        self.directory = str(directory)
        self.shards = manifest.splits[split].shards
        self.capacity = capacity
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[int] = set()

    def get(self, shard: int) -> np.ndarray:
        if shard in self._cache:
            self._cache.move_to_end(shard)
            return self._cache[shard]
        tokens = read_shard(self.directory, self.shards[shard], verify=shard not in self._verified)
        self._verified.add(shard)
        self._cache[shard] = tokens
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return tokens

    def sequences(self, shards: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
        """Token windows in the shards' compact dtype (4x smaller than int64 in transit)."""
        dtype = self.get(int(shards[0])).dtype if len(shards) else np.int64
        out = np.empty((len(shards), length), dtype=dtype)
        for shard in np.unique(shards):  # group by shard so each is decoded once per call
            rows = np.nonzero(shards == shard)[0]
            tokens = self.get(int(shard))
            for row in rows:
                out[row] = tokens[starts[row] : starts[row] + length]
        return out


@dataclass(frozen=True)
class WorkerSlice:
    """Which positions one worker consumes: `per_rank` sequences of every global batch, after
    those of the lower ranks. `shares`: each rank's sequences per step (None: equal)."""

    rank: int
    world_size: int
    global_batch: int
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shares is None:
            object.__setattr__(
                self, "shares", (self.global_batch // self.world_size,) * self.world_size
            )
        assert len(self.shares) == self.world_size and sum(self.shares) == self.global_batch, self

    @property
    def per_rank(self) -> int:
        return self.shares[self.rank]

    def positions(self, first_step: int, num_steps: int) -> np.ndarray:
        steps = np.arange(first_step, first_step + num_steps, dtype=np.int64)[:, None]
        first = sum(self.shares[: self.rank])
        offsets = first + np.arange(self.per_rank, dtype=np.int64)[None, :]
        return (steps * self.global_batch + offsets).reshape(-1)


class _ReadSequences:
    """A Ray Data UDF: step ranges -> the worker's (position, tokens) rows for those steps,
    or one row whose ERROR_COLUMN names what is wrong with a shard (see `pipeline`)."""

    def __init__(self, directory: str, manifest: Manifest, order: SequenceOrder, part: WorkerSlice):
        self.directory, self.manifest, self.order, self.part = directory, manifest, order, part
        self._cache: ShardCache | None = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._cache is None:
            self._cache = ShardCache(self.directory, self.manifest, "train", self.order.window)
        positions = np.concatenate(
            [
                self.part.positions(int(s), int(n))
                for s, n in zip(batch["step"], batch["steps"], strict=True)
            ]
        )
        shards, starts = self.order.locate_many(positions)
        length = self.order.seq_len + 1
        try:
            tokens = self._cache.sequences(shards, starts, length)
        except UserError as exc:
            return {
                "position": np.array([-1]),
                "tokens": np.zeros((1, length), dtype=self.manifest.dtype),
                ERROR_COLUMN: np.array([str(exc)]),
            }
        return {"position": positions, "tokens": tokens, ERROR_COLUMN: np.full(len(positions), "")}


def stream_train_batches(
    directory: str,
    manifest: Manifest,
    order: SequenceOrder,
    part: WorkerSlice,
    batch_size: int,
    first_step: int,
    end_step: int,
    prefetch_batches: int = 4,
    read_cpus: float = 0.5,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields (positions, tokens[batch_size, seq_len + 1]) for steps [first_step, end_step);
    the training loop asks for its whole share of a step at once. A shard that the reader finds
    missing or corrupted raises its UserError here."""
    import ray.data

    items = [
        {"step": s, "steps": min(STEPS_PER_READ_TASK, end_step - s)}
        for s in range(first_step, end_step, STEPS_PER_READ_TASK)
    ]
    if not items:
        return
    # One reader actor, so that one shard cache serves every step.
    dataset = ordered_dataset(items, len(items)).map_batches(
        _ReadSequences,
        fn_constructor_args=(directory, manifest, order, part),
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=read_cpus,
    )
    for batch in dataset.iter_batches(
        batch_size=batch_size, batch_format="numpy", prefetch_batches=prefetch_batches
    ):
        failed = np.flatnonzero(batch["position"] < 0)
        if len(failed):
            raise UserError(str(batch[ERROR_COLUMN][failed[0]]))
        yield batch["position"], batch["tokens"]


class StepStream:
    """A stream of whole steps (replica groups read every step whole) that knows which step
    its next batch belongs to, opened and its first batch read when it is made: Ray Data starts
    its reader then, before the group joins the others, so that a joining group does not keep
    them waiting while it starts. `seek` moves it to the step the group healed to: forward by
    reading on (a few steps: it was opened at the run's step as last seen), back by opening
    it again."""

    def __init__(self, open_at: Callable[[int], Iterator], step: int):
        self._open_at = open_at
        self._open(step)

    def _open(self, step: int) -> None:
        self.step = step
        self._batches = self._open_at(step)
        self._first = next(self._batches, None)  # None: nothing left to read from `step`

    def __iter__(self) -> StepStream:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        batch, self._first = self._first, None
        if batch is None:
            batch = next(self._batches)
        self.step += 1
        return batch

    def seek(self, step: int) -> None:
        if step < self.step:
            self.close()
            self._open(step)
        while self.step < step:
            next(self)

    def close(self) -> None:
        self._batches.close()


@dataclass(frozen=True)
class ValidationShare:
    """One worker's strided share of the fixed validation set, read in batches; its length
    (the number of batches) is known before a shard is read."""

    directory: str
    manifest: Manifest
    seq_len: int
    starts: list[tuple[int, int]]
    batch: int

    def __len__(self) -> int:
        return -(-len(self.starts) // self.batch)

    def __iter__(self) -> Iterator[np.ndarray]:
        cache = ShardCache(self.directory, self.manifest, "val")
        for i in range(0, len(self.starts), self.batch):
            chunk = self.starts[i : i + self.batch]
            yield cache.sequences(
                np.array([s for s, _ in chunk]), np.array([t for _, t in chunk]), self.seq_len + 1
            )


def validation_batches(
    directory: str,
    manifest: Manifest,
    seq_len: int,
    limit: int | None,
    rank: int,
    world: int,
    batch: int,
) -> ValidationShare:
    """This worker's strided share of the first `limit` validation sequences (None: all)."""
    shards = manifest.splits["val"].shards
    starts = validation_starts([s.tokens for s in shards], seq_len, limit)[rank::world]
    return ValidationShare(directory, manifest, seq_len, starts, batch)
