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
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from raytrain_lm import storage
from raytrain_lm.config import DataConfig
from raytrain_lm.data.cap import under_cap, within_cap
from raytrain_lm.data.checks import check_inputs, given_tokenizer
from raytrain_lm.data.curate.dedup import REMOVED_FILE, find_duplicates
from raytrain_lm.data.curate.report import curation_table, manifest_curation
from raytrain_lm.data.curate.samples import RemovedSample
from raytrain_lm.data.curate.stages import KEPT, RECORD, merge, tally
from raytrain_lm.data.manifest import MANIFEST_FILE, Manifest, SplitInfo
from raytrain_lm.data.pipeline import ordered_dataset
from raytrain_lm.data.prepare_tasks import (
    INDEX_COLUMNS,
    METADATA_COLUMNS,
    ROW_TOKENS,
    STOP_FILE,
    duplicate_keys,
    group_alphabet,
    read_group,
    tokenize_group,
    write_shards,
)
from raytrain_lm.data.sources import InputFile, expand_sources
from raytrain_lm.errors import UserError
from raytrain_lm.runtime import ensure_local_ray
from raytrain_lm.tokenization import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    token_dtype,
)

BPE_SAMPLE_BYTES = 20_000_000
READ_TASK_BYTES = 32 * 2**20
CUT_TASK_TOKENS = 1 << 26  # at most this many tokens of shards written by one cutting task
PIECES_DIR = ".pieces"  # inside a local staging folder


@dataclass
class PreparedData:
    directory: str  # local path or URI
    manifest: Manifest
    created: bool  # False when an identical dataset was already published


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
    if cfg.curate.enabled:  # off: the fingerprint of data prepared before curation existed
        key["curate"] = cfg.curate.model_dump(mode="json")
        key["source_of_inputs"] = [i.source for i in inputs]  # scopes and counts follow them
    if held_out_only:
        key["held_out_only"] = True
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _documents(inputs: list[InputFile], udf, tell_parallel: bool = False, **fn_kwargs):
    """`udf` mapped over groups of inputs, in input order, as a Ray Data dataset. With
    `tell_parallel`, the udf learns whether there are fewer groups than CPUs (then a task
    may use more than one thread)."""
    import ray

    items = [
        {"group": n, "uri": i.uri, "size": i.size, "mtime_ns": i.mtime_ns, "source": i.source}
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


def _capped_texts(
    inputs: list[InputFile], cfg: DataConfig, limit: int | None, duplicates: str | None = None
):
    """Document texts in order while their bytes fit under `limit` (for a BPE sample)."""
    documents = _documents(
        inputs, read_group, text_field=cfg.text_field, curate=cfg.curate, duplicates=duplicates
    )
    for rows in within_cap(documents.iter_batches(batch_format="pyarrow", batch_size=None), limit):
        yield from rows.column("text").to_pylist()


def _capped_alphabet(
    inputs: list[InputFile], cfg: DataConfig, duplicates: str | None
) -> CharTokenizer:
    """A char tokenizer for the characters of the documents under `data.max_source_bytes`."""
    chars: set[str] = set()
    rows = _rows(
        _documents(
            inputs, group_alphabet, text_field=cfg.text_field, curate=cfg.curate,
            duplicates=duplicates,
        )
    )  # fmt: skip
    for row, cut in under_cap(rows, cfg.max_source_bytes):
        for index, end, new in zip(row["new_at"], row["new_end"], row["new_chars"], strict=True):
            if cut.keeps(index, end):
                chars.update(new)
    return CharTokenizer(chars)


def _build_tokenizer(
    cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None, duplicates: str | None
) -> Tokenizer:
    tok = cfg.tokenizer
    if given is not None:
        return given
    if tok.kind == "byte":
        return ByteTokenizer()
    if tok.kind == "char":
        return _capped_alphabet(inputs, cfg, duplicates)
    limit = min(BPE_SAMPLE_BYTES, cfg.max_source_bytes or BPE_SAMPLE_BYTES)
    return train_bpe(cfg, inputs, limit, duplicates)


def train_bpe(
    cfg: DataConfig,
    inputs: list[InputFile] | None = None,
    sample_bytes: int = BPE_SAMPLE_BYTES,
    duplicates: str | None = None,
) -> BPETokenizer:
    """Byte-level BPE trained on the first `sample_bytes` of the configured inputs (the one
    pass whose text reaches the driver: a bounded sample, as training BPE needs it)."""
    inputs = inputs if inputs is not None else expand_sources(cfg.sources)
    sample = list(_capped_texts(inputs, cfg, sample_bytes, duplicates))
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
    curation: dict = field(default_factory=dict)  # curate.stages' tally, by source index
    sample: RemovedSample | None = None  # the first removed documents of each rule


def _tokenize_inputs(
    cfg: DataConfig,
    inputs: list[InputFile],
    tokenizer: Tokenizer,
    pieces: str,
    bar,
    duplicates: str | None,
) -> _Stream:
    """Phase 1: tasks tokenize and write pieces; the metadata rows, cut by the byte cap, say
    which pieces (and how much of the last one) make the stream."""
    limit = cfg.max_source_bytes
    dataset = _documents(
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
    rows = _rows(dataset)
    stream = _Stream(sample=RemovedSample(cfg.curate.sample_removed, cfg.sources))
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

    duplicates = None
    if cfg.curate.dedup:  # first: every later pass (tokenizer, stream) reads without them
        keys = _documents(inputs, duplicate_keys, text_field=cfg.text_field, curate=cfg.curate)
        find_duplicates(keys, cfg.curate, pieces)
        duplicates = storage.join(pieces, REMOVED_FILE)
    tokenizer = _build_tokenizer(cfg, inputs, given, duplicates)
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
        stream = _tokenize_inputs(cfg, inputs, tokenizer, pieces, bar, duplicates)
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
    stream.sample.write(shards_dir)
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
        curation=manifest_curation(cfg, stream.curation),
    )
    if manifest.curation is not None:
        print(curation_table(manifest.curation))
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
