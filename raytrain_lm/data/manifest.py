"""The manifest: what a prepared token dataset holds. Written last, so its presence publishes.

Shard checksums are verified once per dataset version, not at every start: a successful check
leaves a stamp (`.verified.json` beside the manifest) recording each shard's checksum, size
and modification time when it was hashed. Later checks, and the workers' reads, hash only
the shards whose expected checksum, size or mtime differ from the stamp (or that have none).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_lm import storage
from raytrain_lm.errors import UserError

MANIFEST_FILE = "manifest.json"
STAMP_FILE = ".verified.json"
# A shard modified within one timestamp tick of being hashed could keep its mtime (ticks are
# ~4 ms on Linux, up to 2 s on FAT or some object stores): such entries are not trusted, so a
# shard is only skipped if its mtime is older than its check by more than this.
RACY_NS = 2_000_000_000
FORMAT_VERSION = 1
TOKENS_COLUMN = "tokens"


@dataclass
class ShardInfo:
    file: str
    tokens: int
    rows: int
    sha256: str


@dataclass
class SplitInfo:
    tokens: int = 0
    shards: list[ShardInfo] = field(default_factory=list)


@dataclass
class Manifest:
    fingerprint: str
    tokenizer_kind: str
    tokenizer_fingerprint: str
    vocab_size: int
    eot_id: int
    dtype: str
    row_tokens: int
    splits: dict[str, SplitInfo]
    inputs: list[dict]
    documents: int
    replaced_bytes: int
    # data.curate's settings and what each stage did, by source (curate/report.py); None: off
    curation: dict | None = None
    format: int = FORMAT_VERSION
    layout: str = "token-stream: documents joined by eot_id, cut into rows of row_tokens"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = storage.join(directory, MANIFEST_FILE)
        try:
            text = storage.read_bytes(path).decode("utf-8")
        except (OSError, ValueError):
            raise UserError(f"no {MANIFEST_FILE} in {directory}: not a prepared dataset") from None
        try:
            raw = json.loads(text)
            raw["splits"] = {
                name: SplitInfo(s["tokens"], [ShardInfo(**x) for x in s["shards"]])
                for name, s in raw["splits"].items()
            }
            manifest = cls(**raw)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: malformed manifest ({exc})") from None
        if manifest.format != FORMAT_VERSION:
            raise UserError(f"{path}: manifest format {manifest.format}, expected {FORMAT_VERSION}")
        return manifest


def mlflow_dataset(directory: str, sources: list[str] | None = None) -> dict[str, str]:
    """The prepared dataset as an MLflow dataset input: named by its fingerprint, the
    manifest's SHA-256 as digest (the shards' checksums are in it), the folder as source, and
    as profile the sources, counts and what curation removed, so that a model in MLflow leads
    back to its exact shards. `sources`: what the config named (None: the manifest's inputs)."""
    raw = storage.read_bytes(storage.join(directory, MANIFEST_FILE))
    manifest = json.loads(raw)
    scheme = directory.split("://", 1)[0] if "://" in directory else "local"
    profile = {
        "sources": sources or sorted({i["input"] for i in manifest["inputs"]}),
        "documents": manifest["documents"],
        "tokens": {name: split["tokens"] for name, split in manifest["splits"].items()},
        "tokenizer": manifest["tokenizer_kind"],
        "vocab_size": manifest["vocab_size"],
        "curation": manifest.get("curation"),
    }
    schema = {"columns": [{"name": TOKENS_COLUMN, "type": f"list<{manifest['dtype']}>"}]}
    return {
        "name": f"raytrain-lm-{manifest['fingerprint']}",
        "digest": hashlib.sha256(raw).hexdigest()[:32],
        "source_type": {"gs": "gcs", "file": "local"}.get(scheme, scheme),
        "source": json.dumps({"uri": str(directory)}),
        "schema": json.dumps(schema),
        "profile": json.dumps(profile),
    }


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    fs, inner = storage.filesystem(path)
    with fs.open_input_stream(inner) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stat(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of a file, None if it does not exist."""
    fs, inner = storage.filesystem(path)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        return None
    return info.size or 0, info.mtime_ns or 0


_stamps: dict[str, tuple[tuple[int, int] | None, dict]] = {}  # path -> (its stat, trusted)


def _trusted(directory: str | Path) -> dict[str, tuple[str, int, int]]:
    """Shard file -> (sha256, size, mtime_ns) that the stamp vouches for.

    Entries hold the checksum the file had, not a manifest version: a shard is vouched for
    exactly when the manifest expects that checksum and the file is as it was when hashed.
    """
    path = storage.join(directory, STAMP_FILE)
    stat = _stat(path)
    if stat is None:
        return {}
    cached = _stamps.get(path)
    if cached is not None and cached[0] == stat:
        return cached[1]  # workers read many shards: parse the stamp once per version of it
    try:
        entries = json.loads(storage.read_bytes(path))["shards"]
        trusted = {
            file: (sha256, size, mtime)
            for file, (sha256, size, mtime, checked) in entries.items()
            if 0 < mtime <= checked - RACY_NS
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        trusted = {}  # unreadable or from an older layout: hash everything, restamp
    _stamps[path] = (stat, trusted)
    return trusted


def _vouched(directory: str | Path, shard: ShardInfo, stat: tuple[int, int] | None) -> bool:
    return stat is not None and _trusted(directory).get(shard.file) == (shard.sha256, *stat)


def _write_stamp(directory: str | Path, shards: dict[str, list]) -> None:
    data = json.dumps({"shards": shards}).encode()
    try:
        if storage.is_uri(directory):
            storage.write_bytes(storage.join(directory, STAMP_FILE), data)
            return
        # Written aside and renamed, so a concurrent reader never sees half a stamp.
        tmp = Path(directory, f"{STAMP_FILE}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, Path(directory, STAMP_FILE))
    except OSError:
        pass  # a read-only dataset is still verified, just at every start


def _check_checksum(path: str, shard: ShardInfo) -> None:
    if file_sha256(path) != shard.sha256:
        raise UserError(f"shard {shard.file} is corrupted: checksum mismatch with the manifest")


def read_tokens(path: str | Path) -> np.ndarray:
    """The token stream stored in one shard file, as a flat array."""
    fs, inner = storage.filesystem(path)
    with fs.open_input_file(inner) as f:
        column = pq.read_table(f, columns=[TOKENS_COLUMN]).column(TOKENS_COLUMN).combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False)


def _missing(directory: str | Path, shard: ShardInfo) -> UserError:
    return UserError(f"shard {shard.file} listed in the manifest is missing from {directory}")


def read_shard(directory: str | Path, shard: ShardInfo, verify: bool = True) -> np.ndarray:
    """All tokens of one shard as a flat array, after checking its checksum (unless the
    verification stamp vouches for the file as it is now)."""
    path = storage.join(directory, shard.file)
    stat = _stat(path)
    if stat is None:
        raise _missing(directory, shard)
    if verify and not _vouched(directory, shard, stat):
        _check_checksum(path, shard)
    tokens = read_tokens(path)
    if len(tokens) != shard.tokens:
        raise UserError(
            f"shard {shard.file} holds {len(tokens)} tokens, manifest says {shard.tokens}"
        )
    return tokens


def verify_shards(directory: str | Path, manifest: Manifest) -> int:
    """Checks every shard's checksum, naming the first corrupted or missing one; shards a
    stamp vouches for are not hashed again. Returns how many shards were hashed."""
    stamp: dict[str, list] = {}
    hashed = 0
    for split in manifest.splits.values():
        for shard in split.shards:
            path = storage.join(directory, shard.file)
            checked = time.time_ns()
            stat = _stat(path)  # before hashing: a change while hashing shows up next time
            if stat is None:
                raise _missing(directory, shard)
            if not _vouched(directory, shard, stat):
                _check_checksum(path, shard)
                hashed += 1
            stamp[shard.file] = [shard.sha256, *stat, checked]
    if hashed:
        _write_stamp(directory, stamp)
    return hashed
