"""`prepare`: text -> token ids -> Parquet token shards + manifest, as a Ray Data job.

Ray Data reads and tokenizes groups of inputs in parallel tasks (each worker process builds
the tokenizer once); the driver consumes the tokenized documents in input order and
writes the token stream into fixed-size shards, so memory stays bounded by a few shards.

The output folder is named by a fingerprint of the inputs and settings: the same inputs give
the same folder (a re-run is a no-op), anything changed gives a new one (never a mix). Shards
are staged and the manifest is written last: a folder without a manifest was never published.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
    read_tokens,
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


def _read_and_tokenize(batch: pa.Table, text_field: str, tokenizer_json: str) -> pa.Table:
    """map_batches: a group of inputs -> one row per document with its token ids.

    Reading and tokenizing in the same task keeps the text inside the worker: only the
    (2-4x smaller) token ids cross the object store, and there is one operator to schedule.
    """
    return _tokenize(_read_group(batch, text_field), tokenizer_json)


@functools.lru_cache(maxsize=2)
def _tokenizer_for(tokenizer_json: str) -> Tokenizer:
    # Ray reuses worker processes across tasks: build each tokenizer once per process.
    return tokenizer_from_json(tokenizer_json)


def _tokenize(batch: pa.Table, tokenizer_json: str) -> pa.Table:
    """Documents -> token ids, each document followed by end-of-text (an error row: none)."""
    tokenizer = _tokenizer_for(tokenizer_json)
    dtype = token_dtype(tokenizer.vocab_size)
    texts = batch.column("text").to_pylist()
    is_document = batch.column(ERROR_COLUMN).is_null().to_numpy(zero_copy_only=False)
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
        encoded = [np.asarray(ids) for ids in tokenizer.encode_batch(texts)]
    eot = np.array([tokenizer.eot_id], dtype=dtype)
    documents = [ids for ids, keep in zip(encoded, is_document, strict=True) if keep]
    parts = [p for ids in documents for p in (ids.astype(dtype, copy=False), eot)]
    lengths = np.array(
        [len(ids) + 1 if keep else 0 for ids, keep in zip(encoded, is_document, strict=True)],
        dtype=np.int64,
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.table(
        {
            "tokens": tokens,
            "bytes": batch.column("bytes"),
            "replaced": batch.column("replaced"),
            "unknown": pa.array(unknown),
            ERROR_COLUMN: batch.column(ERROR_COLUMN),
        }
    )


# ----------------------------------------------------------------------------- driver side


def _fingerprint(cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None) -> str:
    tok = cfg.tokenizer
    tok_identity: dict = {"kind": tok.kind}
    if tok.kind == "bpe":
        tok_identity |= {"path": tok.path, "vocab_size": tok.vocab_size}
        if given is not None:
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
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _documents(inputs: list[InputFile], udf, **fn_kwargs):
    """`udf` mapped over groups of inputs, in input order, as a Ray Data dataset."""
    import ray

    items = [{"uri": i.uri, "size": i.size, "mtime_ns": i.mtime_ns} for i in inputs]
    # One read task per ~READ_TASK_BYTES of input, at least a few per CPU: a task per small
    # file (the standard library has hundreds) costs more in scheduling than in reading.
    total = sum(i.size for i in inputs)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    blocks = min(len(items), max(4 * cpus, total // READ_TASK_BYTES + 1))
    return ordered_dataset(items, max(1, blocks)).map_batches(
        udf, fn_kwargs=fn_kwargs, batch_size=None, batch_format="pyarrow"
    )


def _within_cap(batches: Iterable[pa.Table], limit: int | None) -> Iterator[pa.Table]:
    """The document rows of `batches`, in order, while their bytes fit under `limit` (the
    first document always: the cap never makes an empty corpus). An error row reached on the
    way raises the UserError it carries."""
    total = 0
    for batch in batches:
        errors = batch.column(ERROR_COLUMN)
        failed = pc.index(errors.is_valid(), True).as_py()  # -1: no error row
        rows = batch.slice(0, failed) if failed >= 0 else batch
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
        if failed >= 0:
            raise UserError(errors[failed].as_py())


def _capped_texts(inputs: list[InputFile], cfg: DataConfig, limit: int | None):
    """Document texts in order while their bytes fit under `limit` (for alphabet/BPE sample)."""
    documents = _documents(inputs, _read_group, text_field=cfg.text_field)
    for rows in _within_cap(documents.iter_batches(batch_format="pyarrow", batch_size=None), limit):
        yield from rows.column("text").to_pylist()


def _build_tokenizer(
    cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None
) -> Tokenizer:
    tok = cfg.tokenizer
    if tok.kind == "byte":
        return ByteTokenizer()
    if tok.kind == "char":
        return CharTokenizer.from_texts(_capped_texts(inputs, cfg, cfg.max_source_bytes))
    if given is not None:
        return given
    limit = min(BPE_SAMPLE_BYTES, cfg.max_source_bytes or BPE_SAMPLE_BYTES)
    return train_bpe(cfg, inputs, limit)


def train_bpe(
    cfg: DataConfig, inputs: list[InputFile] | None = None, sample_bytes: int = BPE_SAMPLE_BYTES
) -> BPETokenizer:
    """Byte-level BPE trained on the first `sample_bytes` of the configured inputs."""
    inputs = inputs if inputs is not None else expand_sources(cfg.sources)
    sample = list(_capped_texts(inputs, cfg, sample_bytes))
    if not any(t.strip() for t in sample):
        raise UserError(f"empty corpus: no text in {', '.join(cfg.sources)}")
    return BPETokenizer.train(sample, cfg.tokenizer.vocab_size)


class _ShardWriter:
    """Cuts the incoming token stream into shards of exactly `shard_tokens` tokens."""

    def __init__(self, directory: Path, shard_tokens: int, dtype: np.dtype):
        self.directory, self.shard_tokens, self.dtype = directory, shard_tokens, dtype
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self.shards: list[tuple[str, int, ShardInfo]] = []  # (file, tokens, info) in order

    def append(self, tokens: np.ndarray) -> None:
        self._buffer.append(tokens)
        self._buffered += len(tokens)
        while self._buffered >= self.shard_tokens:
            stream = np.concatenate(self._buffer)
            self._write(stream[: self.shard_tokens])
            rest = stream[self.shard_tokens :]
            self._buffer, self._buffered = [rest], len(rest)

    def close(self) -> None:
        if self._buffered:
            self._write(np.concatenate(self._buffer))
        self._buffer, self._buffered = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        file = f"stream-{len(self.shards):05d}.parquet"
        self.shards.append((file, len(tokens), write_shard(self.directory / file, tokens)))


def write_shard(path: Path, tokens: np.ndarray) -> ShardInfo:
    """Writes one shard; its checksum is taken from the bytes written, not read back."""
    offsets = np.unique(np.append(np.arange(0, len(tokens), ROW_TOKENS), len(tokens))).astype(
        np.int32
    )
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({TOKENS_COLUMN: column}), sink, compression="zstd")
    data = sink.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return ShardInfo(path.name, len(tokens), len(offsets) - 1, hashlib.sha256(data).hexdigest())


def _split(
    staging: Path, shards: list[tuple[str, int, ShardInfo]], n_val: int
) -> dict[str, SplitInfo]:
    """Renames the stream shards into train (head) and val (tail, the last n_val tokens)."""
    total = sum(n for _, n, _ in shards)
    boundary = total - n_val
    splits = {"train": SplitInfo(), "val": SplitInfo()}
    start = 0
    for file, count, info in shards:
        end = start + count
        pieces: list[tuple[str, np.ndarray | None, int]] = []
        if end <= boundary:
            pieces.append(("train", None, count))
        elif start >= boundary:
            pieces.append(("val", None, count))
        else:
            tokens = read_tokens(staging / file)
            cut = boundary - start
            pieces += [("train", tokens[:cut], cut), ("val", tokens[cut:], count - cut)]
        for split_name, tokens, n in pieces:
            split = splits[split_name]
            name = f"{split_name}-{len(split.shards):05d}.parquet"
            if tokens is None:
                os.rename(staging / file, staging / name)
                piece = ShardInfo(name, n, info.rows, info.sha256)
            else:
                piece = write_shard(staging / name, tokens)
            split.shards.append(piece)
            split.tokens += n
        if (staging / file).exists():
            (staging / file).unlink()
        start = end
    return splits


def prepare(cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Prepares (or finds already prepared) token shards for `cfg`; returns where they are.
    Whatever is wrong with the inputs raises a UserError of one line naming the input."""
    inputs = check_inputs(cfg)
    if cfg.prepared:
        return PreparedData(cfg.prepared, Manifest.load(cfg.prepared), created=False)
    given = given_tokenizer(cfg)
    fingerprint = _fingerprint(cfg, inputs, given)
    target = storage.join(cfg.cache_dir, fingerprint)
    if storage.exists(storage.join(target, MANIFEST_FILE)):
        return PreparedData(target, Manifest.load(target), created=False)

    remote = storage.is_uri(cfg.cache_dir)
    created_root = not remote and not Path(cfg.cache_dir).exists()
    try:
        if remote:
            staging = Path(tempfile.mkdtemp(prefix=f"raytrain-{fingerprint}-"))
        else:
            Path(cfg.cache_dir).mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{fingerprint}-", dir=cfg.cache_dir))
    except OSError as exc:
        raise UserError(f"cannot write to data.cache_dir {cfg.cache_dir}: {exc.strerror}") from None
    try:
        ensure_local_ray()
        manifest = _run(cfg, inputs, given, fingerprint, staging, progress)
        _publish(staging, target, manifest, remote)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created_root:  # leave nothing behind on failure, not even the empty cache folder
            shutil.rmtree(cfg.cache_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PreparedData(target, Manifest.load(target), created=True)


def _run(
    cfg: DataConfig,
    inputs: list[InputFile],
    given: Tokenizer | None,
    fingerprint: str,
    staging: Path,
    progress: bool,
) -> Manifest:
    from tqdm import tqdm

    tokenizer = _build_tokenizer(cfg, inputs, given)
    dtype = token_dtype(tokenizer.vocab_size)
    writer = _ShardWriter(staging, cfg.shard_tokens, dtype)
    documents = _documents(
        inputs, _read_and_tokenize, text_field=cfg.text_field, tokenizer_json=tokenizer.to_json()
    )
    # Progress goes to stdout so that stderr carries nothing but problems.
    bar = tqdm(
        desc="prepare",
        unit="tok",
        unit_scale=True,
        disable=not progress,
        smoothing=0.1,
        file=sys.stdout,
    )
    docs = replaced = 0
    batches = documents.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=4)
    for rows in _within_cap(batches, cfg.max_source_bytes):
        if pc.sum(rows.column("unknown")).as_py():
            raise RuntimeError("a document under the byte cap has characters outside the alphabet")
        tokens = rows.column("tokens").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        writer.append(tokens)
        bar.update(len(tokens))
        docs += len(rows)
        replaced += int(pc.sum(rows.column("replaced")).as_py() or 0)
    writer.close()
    bar.close()
    total = sum(n for _, n, _ in writer.shards)
    if docs == 0:
        raise UserError(f"empty corpus: no text in {', '.join(cfg.sources)}")
    n_val = max(int(total * cfg.val_fraction), 2)
    if cfg.val_max_tokens is not None:
        n_val = min(n_val, cfg.val_max_tokens)
    if total - n_val < 2:
        raise UserError(f"corpus too small: {total} tokens cannot make train and validation splits")
    if replaced:
        print(f"[raytrain-lm] replaced {replaced} undecodable bytes with U+FFFD (inputs not UTF-8)")
    tokenizer.save(staging)
    return Manifest(
        fingerprint=fingerprint,
        tokenizer_kind=tokenizer.kind,
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eot_id=tokenizer.eot_id,
        dtype=str(dtype),
        row_tokens=ROW_TOKENS,
        splits=_split(staging, writer.shards, n_val),
        inputs=[i.identity() for i in inputs],
        documents=docs,
        replaced_bytes=replaced,
    )


def _publish(staging: Path, target: str, manifest: Manifest, remote: bool) -> None:
    """Moves staged shards to `target` and writes the manifest there last."""
    if not remote:
        (staging / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            if not Path(
                target, MANIFEST_FILE
            ).is_file():  # lost a race to an identical writer: fine
                raise
        return
    fs, inner = storage.filesystem(target)
    fs.create_dir(inner, recursive=True)
    for path in sorted(staging.iterdir()):
        with open(path, "rb") as src, fs.open_output_stream(f"{inner}/{path.name}") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    storage.write_bytes(storage.join(target, MANIFEST_FILE), manifest.to_json().encode("utf-8"))


__all__ = ["prepare", "train_bpe", "PreparedData", "TOKENIZER_FILE"]
