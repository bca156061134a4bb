"""Phase 2 of `prepare`, the driver's side (prepare.py says how the phases fit together): the
token stream that phase 1 laid out in pieces is cut into shards, exactly where one writer of
the whole stream would cut, and tasks write them from byte ranges of the pieces."""

from __future__ import annotations

import bisect

import numpy as np

from raytrain_lm.data.manifest import SplitInfo
from raytrain_lm.data.prepare_pieces import TokenStream
from raytrain_lm.data.prepare_tasks import write_shards

CUT_TASK_TOKENS = 1 << 26  # at most this many tokens of shards written by one cutting task

# A shard to write: its split, its number in that split, the (piece, start, end) token ranges
# it is made of, and its tokens.
Shard = tuple[str, int, list[tuple[str, int, int]], int]


def _plan_shards(stream: TokenStream, n_val: int, shard_tokens: int) -> list[Shard]:
    """Shards of `shard_tokens` tokens, whose last `n_val` tokens are the validation split (the
    shard that boundary falls in is cut in two), each as the ranges of pieces it covers."""
    total, boundary = stream.tokens, stream.tokens - n_val
    cuts = sorted({0, boundary, total, *range(shard_tokens, total, shard_tokens)})
    starts = np.cumsum([0] + [n for _, n in stream.pieces]).tolist()
    numbering = {"train": 0, "val": 0}
    shards = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        split = "train" if end <= boundary else "val"
        first = bisect.bisect_right(starts, start) - 1
        ranges = []
        for k in range(first, len(stream.pieces)):
            if starts[k] >= end:
                break
            piece_start = max(start, starts[k]) - starts[k]
            piece_end = min(end, starts[k + 1]) - starts[k]
            ranges.append((stream.pieces[k][0], piece_start, piece_end))
        shards.append((split, numbering[split], ranges, end - start))
        numbering[split] += 1
    return shards


def cut_into_shards(
    stream: TokenStream, n_val: int, shard_tokens: int, directory: str, content_named: bool, dtype
) -> dict[str, SplitInfo]:
    """The shards of `_plan_shards`, written into `directory` by tasks that read them from the
    pieces (under names that carry their checksum when `content_named`): each split's shards
    and tokens."""
    import ray

    shards = _plan_shards(stream, n_val, shard_tokens)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    per_task = min(CUT_TASK_TOKENS, max(shard_tokens, stream.tokens // (2 * cpus)))
    writer = ray.remote(num_cpus=1)(write_shards)
    refs, batch, batch_tokens = [], [], 0
    for split, index, ranges, n in shards:
        batch.append((split, index, ranges))
        batch_tokens += n
        if batch_tokens >= per_task:
            refs.append(writer.remote(batch, directory, content_named, str(dtype)))
            batch, batch_tokens = [], 0
    if batch:
        refs.append(writer.remote(batch, directory, content_named, str(dtype)))
    # Every task ends before any failure is raised: none writes after the staging is removed.
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    infos = [info for written in ray.get(refs) for info in written]
    splits = {"train": SplitInfo(), "val": SplitInfo()}
    for (split, *_), info in zip(shards, infos, strict=True):
        splits[split].shards.append(info)
        splits[split].tokens += info.tokens
    return splits
