"""The byte cap (`data.max_source_bytes`): whole documents in input order while their bytes
fit, the first always (the cap never makes an empty corpus). The same rule cuts document rows
(`within_cap`, for a BPE sample) and groups' metadata rows (`under_cap`, for the token stream
and a char alphabet), so every consumer of the documents sees the same corpus. Documents that
curation removed take no room: only kept documents count."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from raytrain_lm.data.pipeline import ERROR_COLUMN
from raytrain_lm.data.prepare_tasks import kept_documents, split_error
from raytrain_lm.errors import UserError


def within_cap(batches: Iterable[pa.Table], limit: int | None) -> Iterator[pa.Table]:
    """The document rows of `batches`, in order, while their bytes fit under `limit` (the
    first document always: the cap never makes an empty corpus). An error row reached on the
    way raises the UserError it carries. `under_cap` is the same rule on whole groups."""
    total = 0
    for batch in batches:
        rows, error = split_error(batch)
        rows = kept_documents(rows)
        sizes = rows.column("bytes").to_numpy()
        take = len(sizes)
        if limit is not None:
            fits = int((np.cumsum(sizes) + total <= limit).sum())
            take = fits if fits or total else min(1, take)
        if take:
            yield rows.slice(0, take)
            total += int(sizes[:take].sum())
        if take < len(sizes) or (limit is not None and total >= limit):
            return  # documents are never blank, so nothing more fits
        if error is not None:
            raise UserError(error)


@dataclass(frozen=True)
class Cut:
    """How much of one group the byte cap keeps: all of it (room None), or its documents
    while their cumulative bytes fit in `room`, and at least one when `first`."""

    room: int | None
    first: bool  # no document was kept before this group
    last: bool = False  # the stream ends in this group: the cap is reached in it

    def keeps(self, index: int, end: int) -> bool:
        """Whether the document `index` of the group, whose bytes end at `end`, is kept."""
        return self.room is None or end <= self.room or (self.first and index == 0)


def under_cap(rows: Iterable[dict], limit: int | None) -> Iterator[tuple[dict, Cut]]:
    """Groups' metadata rows in order, each with what the byte cap keeps of it, while the cap
    leaves room (the rule of `within_cap`: whole documents in order, the first always); the
    group in which the stream ends is marked `last`. An error row reached on the way raises
    the UserError it carries."""
    total = 0
    for row in rows:
        if limit is not None and total + row["bytes"] > limit:
            yield row, Cut(limit - total, total == 0, last=True)
            return  # this group's documents do not all fit: nothing after them does
        full = limit is not None and total + row["bytes"] >= limit
        yield row, Cut(None, total == 0, last=full)
        total += row["bytes"]
        if full:
            return
        if row[ERROR_COLUMN] is not None:
            raise UserError(row[ERROR_COLUMN])
