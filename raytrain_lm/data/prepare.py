"""`prepare`: text -> token ids -> Parquet token shards + manifest, in Ray tasks that write
straight to the target (a local folder or a bucket); the driver handles metadata only. What
the tasks run is in prepare_tasks; the driver's side of each phase is named below.

0. Duplicates (curate/dedup), when on; then the tokenizer (prepare_tokenizer): given, or
   built from the documents under the byte cap.
1. Read and tokenize (a Ray Data job, prepare_job; prepare_pieces). Each task reads a group
   of inputs, tokenizes its documents and writes their token stream (each document followed
   by end-of-text) as one *piece*, a raw array of token ids, to a staging location beside the
   target. It returns one metadata row: the piece's name, its token, document and byte
   counts, the replaced bytes and any problem with the inputs. The driver takes the rows in
   input order and applies the byte cap to them (for the one group the cap cuts, from that
   group's per-document index, a small file beside its piece): it learns the layout of the
   whole token stream without receiving a token.
2. Cut (Ray tasks, prepare_shards). The stream is cut into shards of `data.shard_tokens`
   tokens and its tail of validation tokens split off, exactly where one writer of the whole
   stream would cut: each task reads the byte ranges of the pieces that its shards cover,
   writes the shards to the target and returns their names, token and row counts and
   checksums.
3. Publish (this module). The tokenizer, then the manifest, last: a folder without a
   manifest was never published and is never read.

The output folder is named by a fingerprint of the inputs and settings: the same inputs give
the same folder (a re-run is a no-op), anything changed gives a new one (never a mix). On a
local disk the shards are staged in a hidden folder beside the target, which is renamed into
place. A bucket has no rename: shards are written into the target under names that carry
their checksum (`train-00000-<sha256[:16]>.parquet`), so two prepares of the same inputs
racing each other write the same objects or different ones, never different content under
one name, and whichever manifest is read names shards that exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from raytrain_lm import storage
from raytrain_lm.config import DataConfig
from raytrain_lm.data.checks import check_inputs, given_tokenizer
from raytrain_lm.data.curate.dedup import REMOVED_FILE, find_duplicates
from raytrain_lm.data.curate.report import curation_table, manifest_curation
from raytrain_lm.data.manifest import MANIFEST_FILE, Manifest
from raytrain_lm.data.prepare_job import map_input_groups
from raytrain_lm.data.prepare_pieces import tokenize_into_pieces
from raytrain_lm.data.prepare_shards import cut_into_shards
from raytrain_lm.data.prepare_tasks import ROW_TOKENS, duplicate_keys
from raytrain_lm.data.prepare_tokenizer import build_tokenizer
from raytrain_lm.data.sources import InputFile
from raytrain_lm.errors import UserError
from raytrain_lm.runtime import ensure_local_ray
from raytrain_lm.tokenization import TOKENIZER_FILE, Tokenizer, token_dtype

PIECES_DIR = ".pieces"  # inside a local staging folder


@dataclass
class PreparedData:
    directory: str  # local path or URI
    manifest: Manifest
    created: bool  # False when an identical dataset was already published


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
        keys = map_input_groups(
            inputs, duplicate_keys, text_field=cfg.text_field, curate=cfg.curate
        )
        find_duplicates(keys, cfg.curate, pieces)
        duplicates = storage.join(pieces, REMOVED_FILE)
    tokenizer = build_tokenizer(cfg, inputs, given, duplicates)
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
        stream = tokenize_into_pieces(cfg, inputs, tokenizer, pieces, bar, duplicates)
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
    splits = cut_into_shards(
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


__all__ = ["prepare", "PreparedData"]
