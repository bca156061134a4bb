"""Prepared data in a bucket (the session's S3 server, see support/s3_server.py): `prepare`
publishes there and nowhere else, a second prepare is a no-op, two racing prepares leave one
complete version, workers and validation read the same tokens as from a local copy, and a
bucket that is missing or unreachable is refused in one line before any work."""

from __future__ import annotations

import re
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raytrain_lm import storage
from raytrain_lm.config import DataConfig
from raytrain_lm.data.checks import check_inputs
from raytrain_lm.data.manifest import (
    MANIFEST_FILE,
    RACY_NS,
    Manifest,
    read_shard,
    verify_shards,
)
from raytrain_lm.data.order import SequenceOrder
from raytrain_lm.data.prepare import prepare
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches, validation_batches
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import TOKENIZER_FILE

TEXT = "A bucket holds the shards, 跳过 🐕, and the manifest comes last.\n" * 300


def _corpus(tmp_path: Path) -> str:
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"part {i}. {TEXT}", encoding="utf-8")
    return str(folder)


def _cfg(source: str, cache_dir: str) -> DataConfig:
    return DataConfig(sources=[source], cache_dir=cache_dir, shard_tokens=4096)


def _splits(directory: str, manifest: Manifest) -> dict[str, list[list[int]]]:
    return {
        name: [read_shard(directory, s).tolist() for s in split.shards]
        for name, split in manifest.splits.items()
    }


def _published_keys(manifest: Manifest) -> list[str]:
    files = [s.file for split in manifest.splits.values() for s in split.shards]
    return sorted([*files, MANIFEST_FILE, TOKENIZER_FILE])


def _newest_mtime_ns(directory: str, files: list[str]) -> int:
    fs, inner = storage.filesystem(directory)
    return max(fs.get_file_info(f"{inner}/{f}").mtime_ns for f in files)


def _keys(s3, uri: str) -> list[str]:
    return [k for k in s3.keys(uri) if k]  # "": the folder marker pyarrow may leave


@pytest.fixture
def no_local_writes(tmp_path, monkeypatch):
    """Runs the test in an empty working directory with an empty temporary folder; yields a
    function saying what appeared in either."""
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return lambda: sorted(str(p) for p in [*work.rglob("*"), *temp.rglob("*")])


def test_prepare_publishes_to_a_bucket_and_workers_read_it_from_there(
    s3, tmp_path, no_local_writes
):
    source = _corpus(tmp_path)
    cache = f"{s3.new_bucket('data')}/cache"
    prepared = prepare(_cfg(source, cache), progress=False)
    manifest = prepared.manifest
    fingerprint = manifest.fingerprint
    assert prepared.created and prepared.directory == f"{cache}/{fingerprint}"
    # Shards, tokenizer and manifest in the bucket, named by their content; no staging left;
    # nothing on local disk.
    assert _keys(s3, cache) == [f"{fingerprint}/{k}" for k in _published_keys(manifest)]
    shards = [s.file for split in manifest.splits.values() for s in split.shards]
    assert len(shards) > 4
    assert all(re.fullmatch(r"(train|val)-\d{5}-[0-9a-f]{16}\.parquet", f) for f in shards)
    assert no_local_writes() == []

    again = prepare(_cfg(source, cache), progress=False)
    assert not again.created and again.directory == prepared.directory
    assert _keys(s3, cache) == [f"{fingerprint}/{k}" for k in _published_keys(manifest)]

    # The same tokens, in the same shards, as a local prepare of the same inputs.
    local = prepare(_cfg(source, str(tmp_path / "local")), progress=False)
    assert local.manifest.fingerprint == fingerprint
    assert _splits(prepared.directory, manifest) == _splits(local.directory, local.manifest)
    # A stamp only vouches for shards older than its check by RACY_NS (object stores keep
    # mtimes in whole seconds); on a fast machine the shards are younger than that here.
    time.sleep(
        max(0.0, _newest_mtime_ns(prepared.directory, shards) + RACY_NS - time.time_ns()) / 1e9
    )
    assert verify_shards(prepared.directory, manifest) == len(shards)
    assert verify_shards(prepared.directory, manifest) == 0  # the stamp lives in the bucket

    def validation(directory, m):
        return [b.tolist() for b in validation_batches(directory, m, 32, None, 0, 1, 8)]

    assert validation(prepared.directory, manifest) == validation(local.directory, local.manifest)
    order = SequenceOrder([s.tokens for s in manifest.splits["train"].shards], seq_len=32, seed=1)
    part = WorkerSlice(rank=0, world_size=1, global_batch=8)

    def stream(directory, m):
        return [
            (p.tolist(), t.tolist())
            for p, t in stream_train_batches(directory, m, order, part, 8, 0, 6)
        ]

    assert stream(prepared.directory, manifest) == stream(local.directory, local.manifest)


@pytest.mark.parametrize("where", ["bucket", "local"])
def test_two_concurrent_prepares_leave_one_complete_version(s3, tmp_path, where):
    source = _corpus(tmp_path)
    cache = f"{s3.new_bucket('race')}/cache" if where == "bucket" else str(tmp_path / "cache")
    start = threading.Barrier(2)
    results: list = [None, None]

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = prepare(_cfg(source, cache), progress=False)
        except BaseException as exc:  # handed to the test below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert results[0].directory == results[1].directory
    assert any(r.created for r in results)
    directory = results[0].directory
    manifest = Manifest.load(directory)
    assert verify_shards(directory, manifest) == sum(
        len(s.shards) for s in manifest.splits.values()
    )
    local = prepare(_cfg(source, str(tmp_path / "reference")), progress=False)
    assert _splits(directory, manifest) == _splits(local.directory, local.manifest)
    if where == "bucket":
        stamp = [".verified.json"]
        fingerprint = manifest.fingerprint
        expected = sorted([*_published_keys(manifest), *stamp])
        assert _keys(s3, cache) == [f"{fingerprint}/{k}" for k in expected]
    else:
        assert sorted(p.name for p in Path(cache).iterdir()) == [manifest.fingerprint]


def test_a_missing_or_unreachable_bucket_is_refused_in_one_line_before_any_work(
    s3, tmp_path, no_local_writes, monkeypatch
):
    source = _corpus(tmp_path)
    cfg = _cfg(source, "s3://no-such-bucket-here/cache")
    message = (
        "data.cache_dir s3://no-such-bucket-here/cache: bucket no-such-bucket-here does not exist"
    )
    for attempt in (check_inputs, lambda c: prepare(c, progress=False)):  # check_inputs: no Ray
        with pytest.raises(UserError) as raised:
            attempt(cfg)
        assert str(raised.value) == message

    bucket = s3.new_bucket("down")
    name = bucket.removeprefix("s3://")
    cfg = _cfg(source, f"{bucket}/cache")
    with monkeypatch.context() as env:
        env.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(UserError) as raised:
            check_inputs(cfg)
    assert str(raised.value) == (
        f"data.cache_dir {bucket}/cache: cannot access bucket {name}: "
        "AWS_SECRET_ACCESS_KEY is not set (AWS_ACCESS_KEY_ID is)"
    )
    s3.stop()
    try:
        with pytest.raises(UserError) as raised:
            prepare(cfg, progress=False)
        with pytest.raises(UserError, match="^data.prepared .*: cannot reach bucket"):
            check_inputs(DataConfig(prepared=f"{bucket}/cache/0123456789abcdef"))
    finally:
        s3.start()
    line = str(raised.value)
    assert line.startswith(f"data.cache_dir {bucket}/cache: cannot reach bucket {name} at http")
    assert "\n" not in line
    assert no_local_writes() == []
    assert _keys(s3, bucket) == []
