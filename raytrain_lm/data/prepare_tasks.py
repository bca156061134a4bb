"""What `prepare`'s Ray tasks run (prepare.py says how they fit together): reading (and
curating, data/curate/) and tokenizing a group of inputs into one piece of the token stream (a
Ray Data UDF), an alphabet for a char tokenizer, and writing shards cut from ranges of the
pieces."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raytrain_lm import storage
from raytrain_lm.config.curate import CurateConfig
from raytrain_lm.data.curate.dedup import duplicate_rules, keys_table
from raytrain_lm.data.curate.samples import write_sample
from raytrain_lm.data.curate.stages import KEPT, RECORD, Judged, judge, tally
from raytrain_lm.data.manifest import TOKENS_COLUMN, ShardInfo
from raytrain_lm.data.pipeline import ERROR_COLUMN
from raytrain_lm.data.sources import InputFile, read_documents
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import (
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    token_dtype,
    tokenizer_from_json,
)

ROW_TOKENS = 16384  # Parquet row = one slice of the token stream; rows bound read granularity
STOP_FILE = ".stop"  # beside the pieces: the driver needs no more of them
# The metadata row a reading task returns for its group of inputs: all the driver receives.
METADATA_COLUMNS = (
    "group",  # index of the group's first input
    "piece",  # where its token stream is (null: no documents)
    "tokens",
    "documents",
    "bytes",  # UTF-8 bytes of its documents, as the byte cap counts them
    "replaced",
    "unknown",  # characters outside a char tokenizer's alphabet
    ERROR_COLUMN,  # a problem with an input, met after `documents` documents
    "write_error",  # the piece could not be written
    "curation",  # JSON: what curation did to the group's documents (curate.stages.tally)
    "removed_sample",  # where the first removed documents of each rule are (curate/samples.py)
)
_STRING_COLUMNS = ("piece", ERROR_COLUMN, "write_error", "curation", "removed_sample")
# Beside a piece (with the byte cap), one row per document read, kept or removed: its
# UTF-8 bytes, the end of its tokens in the piece (a removed one's: the previous end), its
# replaced bytes, its unknown characters, then its curation record (curate.stages.RECORD).
INDEX_COLUMNS = ("bytes", "end", "replaced", "unknown", *RECORD)


def read_group(
    batch: pa.Table,
    text_field: str,
    curate: CurateConfig | None = None,
    duplicates: str | None = None,
) -> pa.Table:
    """map_batches: a group of inputs -> their documents in order (text, byte size,
    replaced-byte count, a null ERROR_COLUMN, its id: input index << 32 | ordinal among the
    input's documents, and the curation record of each: its source index, bytes as read, the
    rule that removed it or KEPT, e-mails and IPs replaced). `duplicates`: the file of
    duplicates that curate/dedup.py found, which removes those documents too. A removed
    document stays a row (with no bytes for the cap), so that its counts and a sample of it
    travel; `kept_documents` drops those rows.

    A UserError (an input that cannot be read, a JSON line without the text field) ends the
    group with one more row that carries its message (see `pipeline`); the driver raises it
    if it gets that far, which `data.max_source_bytes` may stop it from doing.
    """
    texts, replaced, errors, docs = [], [], [], []
    records: list[tuple[int, ...]] = []
    sources = batch.column("source").to_pylist() if "source" in batch.column_names else None
    try:
        for n, (group, uri, size, mtime_ns) in enumerate(
            zip(
                batch.column("group").to_pylist(),
                batch.column("uri").to_pylist(),
                batch.column("size").to_pylist(),
                batch.column("mtime_ns").to_pylist(),
                strict=True,
            )
        ):
            source = sources[n] if sources else 0
            ordinal = 0
            for doc in read_documents(InputFile(uri, size, mtime_ns), text_field):
                if not doc.text.strip():
                    continue  # blank documents would only add end-of-text tokens
                read_bytes = len(doc.text.encode("utf-8"))
                judged = Judged(doc.text, KEPT, read_bytes)
                if curate is not None and curate.enabled:
                    judged = judge(doc.text, doc.source, curate)
                texts.append(judged.text)
                replaced.append(doc.replaced_bytes)
                errors.append(None)
                docs.append(group << 32 | ordinal)
                ordinal += 1
                records.append((source, read_bytes, judged.bytes, judged.rule, *judged.pii))
    except UserError as exc:
        texts.append("")
        replaced.append(0)
        errors.append(str(exc))
        docs.append(-1)
        records.append((0, 0, 0, KEPT, 0, 0))
    columns = np.array(records, dtype=np.int64).reshape(-1, len(RECORD))
    rule = columns[:, RECORD.index("rule")]
    if duplicates is not None:
        duplicate = duplicate_rules(np.asarray(docs, dtype=np.int64), duplicates)
        rule[:] = np.where((rule == KEPT) & (duplicate >= 0), duplicate, rule)
    kept = rule == KEPT
    return pa.table(
        {
            "text": pa.array(texts, type=pa.large_string()),
            "bytes": pa.array(np.where(kept, columns[:, RECORD.index("bytes")], 0)),
            "replaced": pa.array(np.where(kept, replaced, 0).astype(np.int64)),
            ERROR_COLUMN: pa.array(errors, type=pa.string()),
            "doc": pa.array(docs, type=pa.int64()),
            **{f"curate_{name}": pa.array(columns[:, i]) for i, name in enumerate(RECORD)},
        }
    )


def duplicate_keys(batch: pa.Table, text_field: str, curate: CurateConfig) -> pa.Table:
    """map_batches: a group of inputs -> the deduplication keys of the documents that PII
    scrubbing and the quality rules kept (curate/dedup.py, stage 1). Each input is read on its
    own: an input that cannot be read ends only its own documents, never those of the inputs
    after it in the group, so the keys do not depend on how inputs are grouped."""
    tables = []
    for n in range(batch.num_rows):
        documents = kept_documents(
            split_error(read_group(batch.slice(n, 1), text_field, curate))[0]
        )
        tables.append(
            keys_table(
                documents.column("doc").to_numpy(),
                documents.column("curate_source").to_numpy(),
                documents.column("text").to_pylist(),
                curate,
            )
        )
    return pa.concat_tables(tables)


def kept_documents(documents: pa.Table) -> pa.Table:
    """The rows of documents that curation kept (all of them when it is off)."""
    return documents.filter(pc.equal(documents.column("curate_rule"), KEPT))


def curation_records(documents: pa.Table) -> np.ndarray:
    """Each document row's curation record (curate.stages.RECORD columns)."""
    return np.stack(
        [documents.column(f"curate_{name}").to_numpy() for name in RECORD], axis=1
    ).reshape(-1, len(RECORD))


def split_error(documents: pa.Table) -> tuple[pa.Table, str | None]:
    """(the document rows, the message of the error row that may end them)."""
    errors = documents.column(ERROR_COLUMN)
    failed = pc.index(errors.is_valid(), True).as_py()  # -1: no error row
    if failed < 0:
        return documents, None
    return documents.slice(0, failed), errors[failed].as_py()


@functools.lru_cache(maxsize=2)
def _tokenizer_for(tokenizer_json: str) -> Tokenizer:
    # Ray reuses worker processes across tasks: build each tokenizer once per process.
    return tokenizer_from_json(tokenizer_json)


def _encode(texts: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the token stream of `texts`, each followed by end-of-text; each one's length in it;
    how many of each one's characters a char tokenizer's alphabet lacks)."""
    dtype = token_dtype(tokenizer.vocab_size)
    unknown = np.zeros(len(texts), dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [tokenizer.encode_array(t) for t in texts]
    elif isinstance(tokenizer, CharTokenizer):
        # The alphabet covers the documents under data.max_source_bytes; tasks run ahead of
        # the cap, and documents past it (which may hold other characters) are discarded.
        pairs = [tokenizer.encode_known(t) for t in texts]
        encoded = [np.asarray(ids, dtype=np.int64) for ids, _ in pairs]
        unknown = np.array([n for _, n in pairs], dtype=np.int64)
    else:
        encoded = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    eot = np.array([tokenizer.eot_id], dtype=dtype)
    parts = [p for ids in encoded for p in (ids.astype(dtype, copy=False), eot)]
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
    return values, lengths, unknown


def _stopped(pieces: str) -> bool:
    return storage.exists(storage.join(pieces, STOP_FILE))


def tokenize_group(
    batch: pa.Table,
    text_field: str,
    tokenizer_json: str,
    pieces: str,
    doc_index: bool,
    parallel: bool,
    curate: CurateConfig | None = None,
    duplicates: str | None = None,
) -> pa.Table:
    """map_batches: a group of inputs -> the token stream of the documents curation kept,
    written as one piece under `pieces`, and one metadata row (METADATA_COLUMNS) about it.

    With `doc_index`, INDEX_COLUMNS of every document read go beside it
    (`<piece>.index.npy`), for the driver to cut the one group that the byte cap falls in,
    and to count what curation did in that group up to the cut. A group that the driver no
    longer needs (STOP_FILE exists) is neither tokenized nor written.
    """
    row: dict = dict.fromkeys(METADATA_COLUMNS, 0)
    row |= {"group": batch.column("group")[0].as_py(), "piece": None}
    row |= {ERROR_COLUMN: None, "write_error": None, "curation": None, "removed_sample": None}
    if not _stopped(pieces):
        documents, row[ERROR_COLUMN] = split_error(
            read_group(batch, text_field, curate, duplicates)
        )
        records = curation_records(documents)
        if curate is not None and curate.enabled:
            row["curation"] = json.dumps(tally(records))
            if curate.sample_removed:
                row["removed_sample"] = write_sample(
                    documents, records, curate.sample_removed, pieces, row["group"]
                )
        kept_mask = records[:, RECORD.index("rule")] == KEPT
        kept = documents.filter(pa.array(kept_mask))
        if kept.num_rows and not _stopped(pieces):
            # Tasks are the parallelism when there are enough of them: one thread each.
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
            tokenizer = _tokenizer_for(tokenizer_json)
            values, lengths, unknown = _encode(kept.column("text").to_pylist(), tokenizer)
            sizes = kept.column("bytes").to_numpy()
            replaced = kept.column("replaced").to_numpy()
            piece = storage.join(pieces, f"piece-{row['group']:08d}.bin")
            if not _stopped(pieces):
                try:
                    storage.write_bytes(piece, pa.py_buffer(values))
                    if doc_index:
                        index = _document_index(documents, records, kept_mask, lengths, unknown)
                        buffer = io.BytesIO()
                        np.save(buffer, index)
                        storage.write_bytes(f"{piece}.index.npy", buffer.getvalue())
                except OSError as exc:
                    row["write_error"] = f"cannot write to data.cache_dir ({piece}): {exc}"
                row |= {
                    "piece": piece,
                    "tokens": len(values),
                    "documents": kept.num_rows,
                    "bytes": int(sizes.sum()),
                    "replaced": int(replaced.sum()),
                    "unknown": int(unknown.sum()),
                }
    schema = pa.schema(
        [
            (name, pa.string() if name in _STRING_COLUMNS else pa.int64())
            for name in METADATA_COLUMNS
        ]
    )
    return pa.Table.from_pylist([row], schema=schema)


def _document_index(
    documents: pa.Table,
    records: np.ndarray,
    kept_mask: np.ndarray,
    lengths: np.ndarray,
    unknown: np.ndarray,
) -> np.ndarray:
    """INDEX_COLUMNS for every document read (removed ones end where the kept one before
    them ended, and have no bytes, replaced bytes or unknown characters of the stream's)."""
    ends = np.cumsum(lengths)
    before = np.cumsum(kept_mask) - 1  # the kept document at or before each one
    all_ends = np.where(before >= 0, ends[before.clip(0)] if len(ends) else 0, 0)
    all_unknown = np.zeros(len(kept_mask), dtype=np.int64)
    all_unknown[kept_mask] = unknown
    sizes = documents.column("bytes").to_numpy()  # 0 for removed documents
    replaced = documents.column("replaced").to_numpy()
    return np.column_stack([sizes, all_ends, replaced, all_unknown, records]).astype(np.int64)


def group_alphabet(
    batch: pa.Table,
    text_field: str,
    curate: CurateConfig | None = None,
    duplicates: str | None = None,
) -> pa.Table:
    """map_batches: a group of inputs -> one row: its document and byte counts, its error,
    and where its alphabet grows: the document (index, cumulative bytes to its end) that
    first holds each character, and those characters. The driver unites the characters of
    the documents under the byte cap without receiving any text."""
    documents, error = split_error(read_group(batch, text_field, curate, duplicates))
    documents = kept_documents(documents)
    seen: set[str] = set()
    at, ends, chars = [], [], []
    end = 0
    for i, (text, size) in enumerate(
        zip(
            documents.column("text").to_pylist(),
            documents.column("bytes").to_pylist(),
            strict=True,
        )
    ):
        end += size
        new = set(text) - seen
        if new:
            seen |= new
            at.append(i)
            ends.append(end)
            chars.append("".join(sorted(new)))
    return pa.table(
        {
            "documents": pa.array([documents.num_rows], type=pa.int64()),
            "bytes": pa.array([end], type=pa.int64()),
            ERROR_COLUMN: pa.array([error], type=pa.string()),
            "new_at": pa.array([at], type=pa.list_(pa.int64())),
            "new_end": pa.array([ends], type=pa.list_(pa.int64())),
            "new_chars": pa.array([chars], type=pa.list_(pa.string())),
        }
    )


# ----------------------------------------------------------------------------- cutting tasks


def shard_bytes(tokens: np.ndarray) -> tuple[bytes, int]:
    """One shard file's bytes (rows of ROW_TOKENS tokens, zstd) and its row count."""
    offsets = np.unique(np.append(np.arange(0, len(tokens), ROW_TOKENS), len(tokens))).astype(
        np.int32
    )
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({TOKENS_COLUMN: column}), sink, compression="zstd")
    return sink.getvalue().to_pybytes(), len(offsets) - 1


def write_shards(
    shards: list[tuple[str, int, list[tuple[str, int, int]]]],
    directory: str,
    content_named: bool,
    dtype: str,
) -> list[ShardInfo]:
    """A Ray task: writes each (split, index, [(piece, first token, end token), ...]) shard
    to `directory` from those ranges of the pieces; checksums come from the bytes written."""
    itemsize = np.dtype(dtype).itemsize
    infos = []
    for split, index, ranges in shards:
        tokens = np.concatenate(
            [
                np.frombuffer(
                    storage.read_range(piece, start * itemsize, (end - start) * itemsize), dtype
                )
                for piece, start, end in ranges
            ]
        )
        data, rows = shard_bytes(tokens)
        sha256 = hashlib.sha256(data).hexdigest()
        name = f"{split}-{index:05d}" + (f"-{sha256[:16]}" if content_named else "") + ".parquet"
        storage.write_bytes(storage.join(directory, name), data)
        infos.append(ShardInfo(name, len(tokens), rows, sha256))
    return infos
