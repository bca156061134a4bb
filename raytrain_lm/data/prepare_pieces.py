"""Phase 1 of `prepare`, the driver's side (prepare.py says how the phases fit together):
tasks read, curate and tokenize groups of inputs and write each group's tokens as a piece;
the driver reads their metadata rows in input order, cuts them at the byte cap and so learns
the layout of the whole token stream without receiving a token."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from raytrain_lm import storage
from raytrain_lm.config import DataConfig
from raytrain_lm.data.cap import under_cap
from raytrain_lm.data.curate.samples import RemovedSample
from raytrain_lm.data.curate.stages import KEPT, RECORD, merge, tally
from raytrain_lm.data.prepare_job import map_input_groups, metadata_rows
from raytrain_lm.data.prepare_tasks import INDEX_COLUMNS, STOP_FILE, tokenize_group
from raytrain_lm.data.sources import InputFile
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import Tokenizer


@dataclass
class TokenStream:
    """The token stream, as the pieces it is made of: (piece, tokens used from its start)."""

    pieces: list[tuple[str, int]] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    replaced: int = 0
    curation: dict = field(default_factory=dict)  # curate.stages' tally, by source index
    sample: RemovedSample | None = None  # the first removed documents of each rule


def tokenize_into_pieces(
    cfg: DataConfig,
    inputs: list[InputFile],
    tokenizer: Tokenizer,
    pieces: str,
    bar,
    duplicates: str | None,
) -> TokenStream:
    """Tasks tokenize and write pieces under `pieces`; the metadata rows, cut by the byte cap,
    say which pieces (and how much of the last one) make the stream."""
    limit = cfg.max_source_bytes
    dataset = map_input_groups(
        inputs,
        tokenize_group,
        tell_parallel=True,
        text_field=cfg.text_field,
        tokenizer_json=tokenizer.to_json(),
        pieces=pieces,
        doc_index=limit is not None,
        curate=cfg.curate,
        duplicates=duplicates,
    )
    rows = metadata_rows(dataset)
    stream = TokenStream(sample=RemovedSample(cfg.curate.sample_removed, cfg.sources))
    try:
        for row, cut in under_cap(rows, limit):
            if row["write_error"]:
                raise UserError(row["write_error"])
            tokens, documents = row["tokens"], row["documents"]
            replaced, unknown = row["replaced"], row["unknown"]
            curation = json.loads(row["curation"]) if row["curation"] else {}
            read = None  # documents of the group in the stream's reach: all
            if cut.last and documents:
                # The stream ends in this group: its per-document index says at which of its
                # documents (the cap may cut it), and curation counts up to that one.
                index = np.load(io.BytesIO(storage.read_bytes(f"{row['piece']}.index.npy")))
                records = index[:, len(INDEX_COLUMNS) - len(RECORD) :]
                kept = np.flatnonzero(records[:, RECORD.index("rule")] == KEPT)
                ends = np.cumsum(index[kept, 0])
                documents = sum(cut.keeps(i, int(e)) for i, e in enumerate(ends))
                read = kept[documents - 1] + 1 if documents else 0
                tokens = int(index[read - 1, 1]) if documents else 0
                replaced = int(index[:read, 2].sum())
                unknown = int(index[:read, 3].sum())
                curation = tally(records[:read]) if row["curation"] else {}
            merge(stream.curation, curation)
            stream.sample.add(row["removed_sample"], curation, read)
            if unknown:  # only with a given alphabet: one built here covers the text
                raise UserError(
                    f"{unknown} characters of {', '.join(cfg.sources)} are not in the char "
                    "tokenizer's alphabet: a char model cannot read them"
                )
            if tokens:
                stream.pieces.append((row["piece"], tokens))
            stream.tokens += tokens
            stream.documents += documents
            stream.replaced += replaced
            bar.update(tokens)
    except Exception:
        _stop_tasks(rows, pieces)
        raise
    _stop_tasks(rows, pieces)
    return stream


def _stop_tasks(rows: Iterator[dict], pieces: str) -> None:
    """Tells the tasks that no more pieces are needed and waits for every one to end, so
    that none writes a piece after the staging is removed: the tasks not yet done return at
    once (they look for STOP_FILE before reading, tokenizing and writing)."""
    with contextlib.suppress(Exception):  # a stopped task's problem is no concern of ours
        storage.write_bytes(storage.join(pieces, STOP_FILE), b"")
        for _ in rows:
            pass
