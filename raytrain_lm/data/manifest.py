"""The manifest: what a prepared token dataset holds. Written last, so its presence publishes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raytrain_lm.data import storage
from raytrain_lm.errors import UserError

MANIFEST_FILE = "manifest.json"
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


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    fs, inner = storage.filesystem(path)
    with fs.open_input_stream(inner) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_checksum(path: str, shard: ShardInfo) -> None:
    if file_sha256(path) != shard.sha256:
        raise UserError(f"shard {shard.file} is corrupted: checksum mismatch with the manifest")


def read_tokens(path: str | Path) -> np.ndarray:
    """The token stream stored in one shard file, as a flat array."""
    fs, inner = storage.filesystem(path)
    with fs.open_input_file(inner) as f:
        column = pq.read_table(f, columns=[TOKENS_COLUMN]).column(TOKENS_COLUMN).combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False)


def read_shard(directory: str | Path, shard: ShardInfo, verify: bool = True) -> np.ndarray:
    """All tokens of one shard as a flat array, after checking its checksum."""
    path = storage.join(directory, shard.file)
    if verify:
        _check_checksum(path, shard)
    tokens = read_tokens(path)
    if len(tokens) != shard.tokens:
        raise UserError(
            f"shard {shard.file} holds {len(tokens)} tokens, manifest says {shard.tokens}"
        )
    return tokens


def verify_shards(directory: str | Path, manifest: Manifest) -> None:
    """Checks every shard's checksum; names the first corrupted or missing one."""
    for split in manifest.splits.values():
        for shard in split.shards:
            path = storage.join(directory, shard.file)
            if not storage.exists(path):
                raise UserError(
                    f"shard {shard.file} listed in the manifest is missing from {directory}"
                )
            _check_checksum(path, shard)
