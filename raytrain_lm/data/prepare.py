"""`prepare`: text -> token ids -> Parquet token shards + manifest, in Ray tasks that write
straight to the target (a local folder or a bucket); the driver handles metadata only.

1. Read and tokenize (a Ray Data job). Each task reads a group of inputs, tokenizes its
   documents and writes their token stream (each document followed by end-of-text) as one
   *piece*, a raw array of token ids, to a staging location beside the target. It returns one
   metadata row: the piece's name, its token, document and byte counts, the replaced bytes
   and any problem with the inputs. The driver takes the rows in input order and applies the
   byte cap to them (for the one group the cap cuts, from that group's per-document index, a
   small file beside its piece): it learns the layout of the whole token stream without
   receiving a token.
2. Cut (Ray tasks). The stream is cut into shards of `data.shard_tokens` tokens and its tail
   of validation tokens split off, exactly where one writer of the whole stream would cut:
   each task reads the byte ranges of the pieces that its shards cover, writes the shards to
   the target and returns their names, token and row counts and checksums.
3. Publish. The tokenizer, then the manifest, last: a folder without a manifest was never
   published and is never read.

The output folder is named by a fingerprint of the inputs and settings: the same inputs give
the same folder (a re-run is a no-op), anything changed gives a new one (never a mix). On a
local disk the shards are staged in a hidden folder beside the target, which is renamed into
place. A bucket has no rename: shards are written into the target under names that carry
their checksum (`train-00000-<sha256[:16]>.parquet`), so two prepares of the same inputs
racing each other write the same objects or different ones, never different content under
one name, and whichever manifest is read names shards that exist.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raytrain_lm import storage
from raytrain_lm.config import DataConfig
from raytrain_lm.data.checks import check_inputs, given_tokenizer
from raytrain_lm.data.manifest import (
    MANIFEST_FILE,
    TOKENS_COLUMN,
    Manifest,
    ShardInfo,
    SplitInfo,
)
from raytrain_lm.data.pipeline import ERROR_COLUMN, ordered_dataset
from raytrain_lm.data.sources import InputFile, expand_sources, read_documents
from raytrain_lm.errors import UserError
from raytrain_lm.runtime import ensure_local_ray
from raytrain_lm.tokenization import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    token_dtype,
    tokenizer_from_json,
)

ROW_TOKENS = 16384  # Parquet row = one slice of the token stream; rows bound read granularity
BPE_SAMPLE_BYTES = 20_000_000
READ_TASK_BYTES = 32 * 2**20
CUT_TASK_TOKENS = 1 << 26  # at most this many tokens of shards written by one cutting task
PIECES_DIR = ".pieces"  # inside a local staging folder
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
)


@dataclass
class PreparedData:
    directory: str  # local path or URI
    manifest: Manifest
    created: bool  # False when an identical dataset was already published


# ----------------------------------------------------------------------------- Ray Data UDFs


def _read_group(batch: pa.Table, text_field: str) -> pa.Table:
    """map_batches: a group of inputs -> their documents in order (text, byte size,
    replaced-byte count, and a null ERROR_COLUMN).

    A UserError (an input that cannot be read, a JSON line without the text field) ends the
    group with one more row that carries its message (see `pipeline`); the driver raises it
    if it gets that far, which `data.max_source_bytes` may stop it from doing.
    """
    texts, sizes, replaced, errors = [], [], [], []
    try:
        for uri, size, mtime_ns in zip(
            batch.column("uri").to_pylist(),
            batch.column("size").to_pylist(),
            batch.column("mtime_ns").to_pylist(),
            strict=True,
        ):
            for doc in read_documents(InputFile(uri, size, mtime_ns), text_field):
                if not doc.text.strip():
                    continue  # blank documents would only add end-of-text tokens
                texts.append(doc.text)
                sizes.append(len(doc.text.encode("utf-8")))
                replaced.append(doc.replaced_bytes)
                errors.append(None)
    except UserError as exc:
        texts.append("")
        sizes.append(0)
        replaced.append(0)
        errors.append(str(exc))
    return pa.table(
        {
            "text": pa.array(texts, type=pa.large_string()),
            "bytes": pa.array(sizes, type=pa.int64()),
            "replaced": pa.array(replaced, type=pa.int64()),
            ERROR_COLUMN: pa.array(errors, type=pa.string()),
        }
    )


def _split_error(documents: pa.Table) -> tuple[pa.Table, str | None]:
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


def _tokenize_group(
    batch: pa.Table,
    text_field: str,
    tokenizer_json: str,
    pieces: str,
    doc_index: bool,
    parallel: bool,
) -> pa.Table:
    """map_batches: a group of inputs -> their token stream written as one piece under
    `pieces`, and one metadata row (METADATA_COLUMNS) about it.

    With `doc_index`, each document's byte size, end in the piece, replaced bytes and unknown
    characters go beside it (`<piece>.index.npy`), for the driver to cut the one group that
    the byte cap falls in. A group that the driver no longer needs (STOP_FILE exists) is
    neither tokenized nor written.
    """
    row: dict = dict.fromkeys(METADATA_COLUMNS, 0)
    row |= {"group": batch.column("group")[0].as_py(), "piece": None}
    row |= {ERROR_COLUMN: None, "write_error": None}
    if not _stopped(pieces):
        documents, row[ERROR_COLUMN] = _split_error(_read_group(batch, text_field))
        if documents.num_rows and not _stopped(pieces):
            # Tasks are the parallelism when there are enough of them: one thread each.
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
            tokenizer = _tokenizer_for(tokenizer_json)
            texts = documents.column("text").to_pylist()
            values, lengths, unknown = _encode(texts, tokenizer)
            sizes = documents.column("bytes").to_numpy()
            replaced = documents.column("replaced").to_numpy()
            piece = storage.join(pieces, f"piece-{row['group']:08d}.bin")
            if not _stopped(pieces):
                try:
                    storage.write_bytes(piece, pa.py_buffer(values))
                    if doc_index:
                        index = np.stack([sizes, np.cumsum(lengths), replaced, unknown], axis=1)
                        buffer = io.BytesIO()
                        np.save(buffer, index.astype(np.int64))
                        storage.write_bytes(f"{piece}.index.npy", buffer.getvalue())
                except OSError as exc:
                    row["write_error"] = f"cannot write to data.cache_dir ({piece}): {exc}"
                row |= {
                    "piece": piece,
                    "tokens": len(values),
                    "documents": documents.num_rows,
                    "bytes": int(sizes.sum()),
                    "replaced": int(replaced.sum()),
                    "unknown": int(unknown.sum()),
                }
    schema = pa.schema(
        [
            (name, pa.string() if name in ("piece", ERROR_COLUMN, "write_error") else pa.int64())
            for name in METADATA_COLUMNS
        ]
    )
    return pa.Table.from_pylist([row], schema=schema)


def _group_alphabet(batch: pa.Table, text_field: str) -> pa.Table:
    """map_batches: a group of inputs -> one row: its document and byte counts, its error,
    and where its alphabet grows: the document (index, cumulative bytes to its end) that
    first holds each character, and those characters. The driver unites the characters of
    the documents under the byte cap without receiving any text."""
    documents, error = _split_error(_read_group(batch, text_field))
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


def _write_shards(
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


# ----------------------------------------------------------------------------- driver side


def _fingerprint(
    cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None, held_out_only: bool
) -> str:
    tok = cfg.tokenizer
    tok_identity: dict = {"kind": tok.kind}
    if tok.kind == "bpe":
        tok_identity |= {"path": tok.path, "vocab_size": tok.vocab_size}
    if given is not None and (tok.kind == "bpe" or held_out_only):
        tok_identity["fingerprint"] = given.fingerprint
    key = {
        "format": 2,
        "inputs": [i.identity() for i in inputs],
        "text_field": cfg.text_field,
        "tokenizer": tok_identity,
        "val_fraction": cfg.val_fraction,
        "val_max_tokens": cfg.val_max_tokens,
        "max_source_bytes": cfg.max_source_bytes,
        "shard_tokens": cfg.shard_tokens,
    }
    if held_out_only:
        key["held_out_only"] = True
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _documents(inputs: list[InputFile], udf, tell_parallel: bool = False, **fn_kwargs):
    """`udf` mapped over groups of inputs, in input order, as a Ray Data dataset. With
    `tell_parallel`, the udf learns whether there are fewer groups than CPUs (then a task
    may use more than one thread)."""
    import ray

    items = [
        {"group": n, "uri": i.uri, "size": i.size, "mtime_ns": i.mtime_ns}
        for n, i in enumerate(inputs)
    ]
    # One read task per ~READ_TASK_BYTES of input, at least a few per CPU: a task per small
    # file (the standard library has hundreds) costs more in scheduling than in reading.
    total = sum(i.size for i in inputs)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    blocks = max(1, min(len(items), max(4 * cpus, total // READ_TASK_BYTES + 1)))
    if tell_parallel:
        fn_kwargs["parallel"] = blocks < cpus
    return ordered_dataset(items, blocks).map_batches(
        udf, fn_kwargs=fn_kwargs, batch_size=None, batch_format="pyarrow"
    )


def _rows(dataset) -> Iterator[dict]:
    """The rows of a dataset of small metadata rows, in order."""
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        yield from batch.to_pylist()


def _within_cap(batches: Iterable[pa.Table], limit: int | None) -> Iterator[pa.Table]:
    """The document rows of `batches`, in order, while their bytes fit under `limit` (the
    first document always: the cap never makes an empty corpus). An error row reached on the
    way raises the UserError it carries. `_under_cap` is the same rule on whole groups."""
    total = 0
    for batch in batches:
        rows, error = _split_error(batch)
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
class _Cut:
    """How much of one group the byte cap keeps: all of it (room None), or its documents
    while their cumulative bytes fit in `room`, and at least one when `first`."""

    room: int | None
    first: bool  # no document was kept before this group

    def keeps(self, index: int, end: int) -> bool:
        """Whether the document `index` of the group, whose bytes end at `end`, is kept."""
        return self.room is None or end <= self.room or (self.first and index == 0)


def _under_cap(rows: Iterable[dict], limit: int | None) -> Iterator[tuple[dict, _Cut]]:
    """Groups' metadata rows in order, each with what the byte cap keeps of it, while the cap
    leaves room (the rule of `_within_cap`: whole documents in order, the first always). An
    error row reached on the way raises the UserError it carries."""
    total = 0
    for row in rows:
        if limit is not None and total + row["bytes"] > limit:
            yield row, _Cut(limit - total, total == 0)
            return  # this group's documents do not all fit: nothing after them does
        yield row, _Cut(None, total == 0)
        total += row["bytes"]
        if limit is not None and total >= limit:
            return
        if row[ERROR_COLUMN] is not None:
            raise UserError(row[ERROR_COLUMN])


def _capped_texts(inputs: list[InputFile], cfg: DataConfig, limit: int | None):
    """Document texts in order while their bytes fit under `limit` (for a BPE sample)."""
    documents = _documents(inputs, _read_group, text_field=cfg.text_field)
    for rows in _within_cap(documents.iter_batches(batch_format="pyarrow", batch_size=None), limit):
        yield from rows.column("text").to_pylist()


def _capped_alphabet(inputs: list[InputFile], cfg: DataConfig) -> CharTokenizer:
    """A char tokenizer for the characters of the documents under `data.max_source_bytes`."""
    chars: set[str] = set()
    rows = _rows(_documents(inputs, _group_alphabet, text_field=cfg.text_field))
    for row, cut in _under_cap(rows, cfg.max_source_bytes):
        for index, end, new in zip(row["new_at"], row["new_end"], row["new_chars"], strict=True):
            if cut.keeps(index, end):
                chars.update(new)
    return CharTokenizer(chars)


def _build_tokenizer(
    cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None
) -> Tokenizer:
    tok = cfg.tokenizer
    if given is not None:
        return given
    if tok.kind == "byte":
        return ByteTokenizer()
    if tok.kind == "char":
        return _capped_alphabet(inputs, cfg)
    limit = min(BPE_SAMPLE_BYTES, cfg.max_source_bytes or BPE_SAMPLE_BYTES)
    return train_bpe(cfg, inputs, limit)


def train_bpe(
    cfg: DataConfig, inputs: list[InputFile] | None = None, sample_bytes: int = BPE_SAMPLE_BYTES
) -> BPETokenizer:
    """Byte-level BPE trained on the first `sample_bytes` of the configured inputs (the one
    pass whose text reaches the driver: a bounded sample, as training BPE needs it)."""
    inputs = inputs if inputs is not None else expand_sources(cfg.sources)
    sample = list(_capped_texts(inputs, cfg, sample_bytes))
    if not any(t.strip() for t in sample):
        raise UserError(f"empty corpus: no text in {', '.join(cfg.sources)}")
    return BPETokenizer.train(sample, cfg.tokenizer.vocab_size)


@dataclass
class _Stream:
    """The token stream, as the pieces it is made of: (piece, tokens used from its start)."""

    pieces: list[tuple[str, int]] = field(default_factory=list)
    tokens: int = 0
    documents: int = 0
    replaced: int = 0


def _tokenize_inputs(
    cfg: DataConfig, inputs: list[InputFile], tokenizer: Tokenizer, pieces: str, bar
) -> _Stream:
    """Phase 1: tasks tokenize and write pieces; the metadata rows, cut by the byte cap, say
    which pieces (and how much of the last one) make the stream."""
    limit = cfg.max_source_bytes
    dataset = _documents(
        inputs,
        _tokenize_group,
        tell_parallel=True,
        text_field=cfg.text_field,
        tokenizer_json=tokenizer.to_json(),
        pieces=pieces,
        doc_index=limit is not None,
    )
    rows = _rows(dataset)
    stream = _Stream()
    try:
        for row, cut in _under_cap(rows, limit):
            if row["write_error"]:
                raise UserError(row["write_error"])
            tokens, documents = row["tokens"], row["documents"]
            replaced, unknown = row["replaced"], row["unknown"]
            if cut.room is not None and documents:
                # The one group the cap falls in: its per-document index says where to cut.
                index = np.load(io.BytesIO(storage.read_bytes(f"{row['piece']}.index.npy")))
                ends = np.cumsum(index[:, 0])
                documents = sum(cut.keeps(i, int(e)) for i, e in enumerate(ends))
                tokens = int(index[documents - 1, 1]) if documents else 0
                replaced = int(index[:documents, 2].sum())
                unknown = int(index[:documents, 3].sum())
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
        _stop(rows, pieces)
        raise
    _stop(rows, pieces)
    return stream


def _stop(rows: Iterator[dict], pieces: str) -> None:
    """Tells the tasks that no more pieces are needed and waits for every one to end, so
    that none writes a piece after the staging is removed: the tasks not yet done return at
    once (they look for STOP_FILE before reading, tokenizing and writing)."""
    with contextlib.suppress(Exception):  # a stopped task's problem is no concern of ours
        storage.write_bytes(storage.join(pieces, STOP_FILE), b"")
        for _ in rows:
            pass


def _cut_into_shards(
    stream: _Stream, n_val: int, shard_tokens: int, directory: str, content_named: bool, dtype
) -> dict[str, SplitInfo]:
    """Phase 2: the stream cut into shards of `shard_tokens` tokens, whose last `n_val` tokens
    are the validation split (the shard that boundary falls in is cut in two), written by
    tasks from the pieces."""
    import ray

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

    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    per_task = min(CUT_TASK_TOKENS, max(shard_tokens, total // (2 * cpus)))
    writer = ray.remote(num_cpus=1)(_write_shards)
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


def prepare(
    cfg: DataConfig,
    progress: bool = True,
    *,
    tokenizer: Tokenizer | None = None,
    held_out_only: bool = False,
) -> PreparedData:
    """Prepares (or finds already prepared) token shards for `cfg`; returns where they are.
    Whatever is wrong with the inputs raises a UserError of one line naming the input; a
    `data.cache_dir` bucket that does not exist or cannot be reached, naming the bucket.

    `tokenizer` (of `data.tokenizer.kind`) replaces the one the config would load or build;
    `held_out_only` puts every token into the val split: text to evaluate a model on."""
    inputs = check_inputs(cfg)
    if cfg.prepared:
        return PreparedData(cfg.prepared, Manifest.load(cfg.prepared), created=False)
    given = tokenizer or given_tokenizer(cfg)
    fingerprint = _fingerprint(cfg, inputs, given, held_out_only)
    target = storage.join(cfg.cache_dir, fingerprint)
    if storage.exists(storage.join(target, MANIFEST_FILE)):
        return PreparedData(target, Manifest.load(target), created=False)

    remote = storage.is_uri(cfg.cache_dir)
    created_root = not remote and not Path(cfg.cache_dir).exists()
    try:
        if remote:
            # Pieces under a prefix of this attempt's own; shards straight into the target.
            staging = storage.join(cfg.cache_dir, f".staging-{fingerprint}-{uuid.uuid4().hex}")
            pieces, shards_dir = staging, target
            storage.makedirs(staging)  # a file:// folder; nothing on an object store
            storage.makedirs(target)
        else:
            Path(cfg.cache_dir).mkdir(parents=True, exist_ok=True)
            staging = str(
                Path(tempfile.mkdtemp(prefix=f".{fingerprint}-", dir=cfg.cache_dir)).absolute()
            )
            pieces, shards_dir = str(Path(staging, PIECES_DIR)), staging
            Path(pieces).mkdir()
    except OSError as exc:
        raise UserError(f"cannot write to data.cache_dir {cfg.cache_dir}: {exc.strerror}") from None
    try:
        ensure_local_ray()
        manifest, used = _run(
            cfg, inputs, given, fingerprint, pieces, shards_dir, progress, held_out_only
        )
        storage.delete_tree(pieces)
        created = _publish(staging, target, manifest, used, remote)
    except BaseException:
        if created_root:  # leave nothing behind on failure, not even the empty cache folder
            shutil.rmtree(cfg.cache_dir, ignore_errors=True)
        raise
    finally:
        with contextlib.suppress(OSError):
            storage.delete_tree(staging)
    return PreparedData(target, Manifest.load(target), created=created)


def _run(
    cfg: DataConfig,
    inputs: list[InputFile],
    given: Tokenizer | None,
    fingerprint: str,
    pieces: str,
    shards_dir: str,
    progress: bool,
    held_out_only: bool = False,
) -> tuple[Manifest, Tokenizer]:
    from tqdm import tqdm

    tokenizer = _build_tokenizer(cfg, inputs, given)
    dtype = token_dtype(tokenizer.vocab_size)
    # Progress goes to stdout so that stderr carries nothing but problems.
    bar = tqdm(
        desc="prepare",
        unit="tok",
        unit_scale=True,
        disable=not progress,
        smoothing=0.1,
        file=sys.stdout,
    )
    try:
        stream = _tokenize_inputs(cfg, inputs, tokenizer, pieces, bar)
    finally:
        bar.close()
    total = stream.tokens
    if stream.documents == 0:
        raise UserError(f"empty corpus: no text in {', '.join(cfg.sources)}")
    n_val = max(int(total * cfg.val_fraction), 2)
    if cfg.val_max_tokens is not None:
        n_val = min(n_val, cfg.val_max_tokens)
    if held_out_only:
        n_val = total
    elif total - n_val < 2:
        raise UserError(f"corpus too small: {total} tokens cannot make train and validation splits")
    if stream.replaced:
        print(
            f"[raytrain-lm] replaced {stream.replaced} undecodable bytes with U+FFFD "
            "(inputs not UTF-8)"
        )
    splits = _cut_into_shards(
        stream, n_val, cfg.shard_tokens, shards_dir, storage.is_uri(shards_dir), dtype
    )
    manifest = Manifest(
        fingerprint=fingerprint,
        tokenizer_kind=tokenizer.kind,
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eot_id=tokenizer.eot_id,
        dtype=str(dtype),
        row_tokens=ROW_TOKENS,
        splits=splits,
        inputs=[i.identity() for i in inputs],
        documents=stream.documents,
        replaced_bytes=stream.replaced,
    )
    return manifest, tokenizer


def _publish(
    staging: str, target: str, manifest: Manifest, tokenizer: Tokenizer, remote: bool
) -> bool:
    """Publishes the shards at `target` with the tokenizer and, last, the manifest. False
    when an identical prepare published first (its manifest is kept)."""
    if not remote:
        tokenizer.save(staging)
        Path(staging, MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            if not Path(target, MANIFEST_FILE).is_file():
                raise
            return False  # lost a race to an identical writer: fine
        return True
    # A bucket has no rename. The shards are in place under names of their content; the
    # tokenizer of these inputs is the same whoever prepares them; the manifest, one PUT,
    # comes last. A prepare that finds one published keeps it.
    if storage.exists(storage.join(target, MANIFEST_FILE)):
        return False
    storage.write_bytes(storage.join(target, TOKENIZER_FILE), tokenizer.to_json().encode("utf-8"))
    storage.write_bytes(storage.join(target, MANIFEST_FILE), manifest.to_json().encode("utf-8"))
    return True


__all__ = ["prepare", "train_bpe", "PreparedData", "TOKENIZER_FILE", "METADATA_COLUMNS"]
