"""The global order of training sequences: a pure function of (seed, epoch, position).

A *sequence* is `seq_len + 1` consecutive tokens of one shard (inputs plus shifted targets).
Epoch e cuts every shard at a seeded offset o_e in [0, seq_len) with stride seq_len, permutes
the shards, groups them into windows of `window` shards and permutes the sequences of each
window. A *position* counts sequences consumed since the run began, across epochs; it never
depends on the number of workers, so it is the whole data state a checkpoint needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from raytrain_lm.errors import UserError

_SPLIT_NAMES = {"train": "training", "val": "validation"}


def check_split_holds_a_sequence(split: str, shard_tokens: Sequence[int], seq_len: int) -> None:
    """The one rule for how small a split ("train" or "val") may be: a sequence never crosses
    a shard, so some shard must hold a whole one (`seq_len + 1` tokens)."""
    needed = seq_len + 1
    if max(shard_tokens, default=0) >= needed:
        return
    total = sum(shard_tokens)
    if total >= needed:
        advice = "use a larger data.shard_tokens or a smaller model.block_size"
    elif split == "val":
        advice = "use more data, a larger data.val_fraction or a smaller model.block_size"
    else:
        advice = "use more data or a smaller model.block_size"
    raise UserError(
        f"{_SPLIT_NAMES[split]} split too small: {total} tokens, but no shard holds a whole "
        f"sequence of {needed} (model.block_size + 1); {advice}"
    )


@dataclass(frozen=True)
class _EpochLayout:
    offset: int
    window_shards: list[np.ndarray]  # shard ids per window, in permuted order
    window_starts: np.ndarray  # first epoch index of each window, plus the epoch size at the end
    size: int


@dataclass(eq=False)
class SequenceOrder:
    shard_tokens: list[int]
    seq_len: int
    seed: int
    window: int = 8
    _epoch_starts: list[int] = field(default_factory=lambda: [0], repr=False)

    def __post_init__(self) -> None:
        check_split_holds_a_sequence("train", self.shard_tokens, self.seq_len)
        self._make_caches()

    def _make_caches(self) -> None:
        self._layout = lru_cache(maxsize=4)(self._build_layout)
        self._window_perm = lru_cache(maxsize=16)(self._build_window_perm)

    def __getstate__(self) -> dict:  # caches are rebuilt, not shipped to Ray Data tasks
        return {k: v for k, v in self.__dict__.items() if k not in ("_layout", "_window_perm")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._make_caches()

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def _counts(self, offset: int) -> np.ndarray:
        tokens = np.asarray(self.shard_tokens, dtype=np.int64)
        return np.maximum(0, (tokens - 1 - offset) // self.seq_len)

    def _build_layout(self, epoch: int) -> _EpochLayout:
        offset = int(self._rng(epoch, 0).integers(self.seq_len))
        counts = self._counts(offset)
        shards = self._rng(epoch, 1).permutation(len(self.shard_tokens))
        windows = [shards[i : i + self.window] for i in range(0, len(shards), self.window)]
        sizes = np.array([counts[w].sum() for w in windows], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return _EpochLayout(offset, windows, starts, int(starts[-1]))

    def _build_window_perm(self, epoch: int, window: int) -> np.ndarray:
        layout = self._layout(epoch)
        size = int(layout.window_starts[window + 1] - layout.window_starts[window])
        return self._rng(epoch, 2, window).permutation(size)

    def epoch_size(self, epoch: int) -> int:
        return self._layout(epoch).size

    def epoch_of(self, position: int) -> tuple[int, int]:
        """position -> (epoch, index within that epoch)."""
        while self._epoch_starts[-1] <= position:
            epoch = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.epoch_size(epoch))
        epoch = int(np.searchsorted(self._epoch_starts, position, side="right")) - 1
        return epoch, position - self._epoch_starts[epoch]

    def locate(self, position: int) -> tuple[int, int]:
        """position -> (shard id, index of its first token in that shard)."""
        shards, starts = self.locate_many(np.array([position]))
        return int(shards[0]), int(starts[0])

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: arrays of shard ids and first-token offsets."""
        positions = np.asarray(positions, dtype=np.int64)
        shards = np.empty(len(positions), dtype=np.int64)
        starts = np.empty(len(positions), dtype=np.int64)
        if len(positions) == 0:
            return shards, starts
        self.epoch_of(int(positions.max()))  # extend the epoch table far enough
        epoch_starts = np.asarray(self._epoch_starts, dtype=np.int64)
        epochs = np.searchsorted(epoch_starts, positions, side="right") - 1
        for epoch in np.unique(epochs):
            in_epoch = np.nonzero(epochs == epoch)[0]
            layout = self._layout(int(epoch))
            index = positions[in_epoch] - epoch_starts[epoch]
            windows = np.searchsorted(layout.window_starts, index, side="right") - 1
            counts = self._counts(layout.offset)
            for window in np.unique(windows):
                rows = in_epoch[windows == window]
                local = self._window_perm(int(epoch), int(window))[
                    index[windows == window] - layout.window_starts[window]
                ]
                members = layout.window_shards[window]
                bounds = np.cumsum(counts[members])
                slot = np.searchsorted(bounds, local, side="right")
                within = local - (bounds[slot] - counts[members][slot])
                shards[rows] = members[slot]
                starts[rows] = layout.offset + within * self.seq_len
        return shards, starts


def validation_starts(
    shard_tokens: list[int], seq_len: int, limit: int | None
) -> list[tuple[int, int]]:
    """The fixed validation set: (shard, first token) of consecutive sequences, unshuffled."""
    check_split_holds_a_sequence("val", shard_tokens, seq_len)
    starts = []
    for shard, tokens in enumerate(shard_tokens):
        for i in range((tokens - 1) // seq_len):
            if limit is not None and len(starts) >= limit:
                return starts
            starts.append((shard, i * seq_len))
    return starts
