import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from raytrain_lm.config import DataConfig
from raytrain_lm.data import manifest as manifest_module
from raytrain_lm.data.manifest import Manifest, read_shard, verify_shards
from raytrain_lm.data.order import SequenceOrder, validation_starts
from raytrain_lm.data.prepare import prepare
from raytrain_lm.data.stream import WorkerSlice, stream_train_batches
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import load_tokenizer

TEXT = "The quick brown fox 跳过 the lazy dog 🐕.\n" * 400


def _cfg(tmp_path, **kw):
    return DataConfig(
        sources=[str(tmp_path / "corpus.txt")],
        cache_dir=str(tmp_path / "data"),
        shard_tokens=4096,
        **kw,
    )


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_prepare_round_trips_text_through_shards(tmp_path, kind):
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    cfg = _cfg(tmp_path, tokenizer={"kind": kind, "vocab_size": 300})
    prepared = prepare(cfg)
    manifest = Manifest.load(prepared.directory)
    tok = load_tokenizer(prepared.directory)
    assert manifest.tokenizer_fingerprint == tok.fingerprint and manifest.tokenizer_kind == kind
    if kind != "bpe":  # BPE squeezes this repetitive text into one shard
        assert len(manifest.splits["train"].shards) > 1  # 4096-token shards
    stream = np.concatenate(
        [
            read_shard(prepared.directory, s)
            for split in ("train", "val")
            for s in manifest.splits[split].shards
        ]
    )
    assert stream.dtype == np.dtype(manifest.dtype)
    assert stream[-1] == manifest.eot_id
    assert tok.decode(stream.tolist()) == TEXT


def test_prepare_is_idempotent_and_versions_changes(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    first = prepare(_cfg(tmp_path))
    again = prepare(_cfg(tmp_path))
    assert first.created and not again.created and again.directory == first.directory
    other = prepare(_cfg(tmp_path, val_fraction=0.2))
    assert other.created and other.directory != first.directory
    (tmp_path / "corpus.txt").write_text(TEXT + "more text")
    changed = prepare(_cfg(tmp_path))
    assert changed.created and changed.directory not in (first.directory, other.directory)
    assert not [
        p for p in (tmp_path / "data").iterdir() if p.name.startswith(".")
    ]  # no staging left


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(TEXT.encode() + b"\xff\xfe bad bytes")
    manifest = prepare(_cfg(tmp_path)).manifest
    assert manifest.replaced_bytes == 2


def test_corrupted_shard_is_named(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    prepared = prepare(_cfg(tmp_path))
    shard = prepared.manifest.splits["train"].shards[0]
    path = Path(prepared.directory) / shard.file
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(UserError, match=f"shard {shard.file} is corrupted"):
        read_shard(prepared.directory, shard)
    path.unlink()
    with pytest.raises(UserError, match=f"shard {shard.file} listed in the manifest is missing"):
        read_shard(prepared.directory, shard)


def test_shards_are_hashed_once_per_version_and_corruption_is_still_named(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text(TEXT)
    prepared = prepare(_cfg(tmp_path))
    directory, manifest = prepared.directory, prepared.manifest
    shards = [s for split in manifest.splits.values() for s in split.shards]
    assert len(shards) > 2
    week_ago = time.time() - 7 * 86400  # as a dataset prepared earlier, not just now
    for shard in shards:
        os.utime(Path(directory) / shard.file, (week_ago, week_ago))

    assert verify_shards(directory, manifest) == len(shards)  # first start: every shard
    assert verify_shards(directory, manifest) == 0  # later starts: none
    hashed = []
    real_sha256 = manifest_module.file_sha256
    monkeypatch.setattr(
        manifest_module, "file_sha256", lambda path: hashed.append(path) or real_sha256(path)
    )
    for shard in shards:  # workers' first reads trust the stamp too
        read_shard(directory, shard)
    assert hashed == []

    # Same size, new mtime: that shard alone is hashed again, and refused by name.
    first = Path(directory) / shards[0].file
    good = first.read_bytes()
    first.write_bytes(good[:-8] + b"garbage!")
    with pytest.raises(UserError, match=f"shard {shards[0].file} is corrupted"):
        verify_shards(directory, manifest)
    with pytest.raises(UserError, match=f"shard {shards[0].file} is corrupted"):
        read_shard(directory, shards[0])
    assert len(hashed) == 2 and all(h.endswith(shards[0].file) for h in hashed)

    # A shard modified within a timestamp tick of its check is hashed until it is older.
    first.write_bytes(good)
    assert verify_shards(directory, manifest) == 1
    assert verify_shards(directory, manifest) == 1
    os.utime(first, (week_ago, week_ago))
    assert verify_shards(directory, manifest) == 1
    assert verify_shards(directory, manifest) == 0

    # The stamp vouches for a checksum, not a folder: another manifest version is rechecked.
    other = Manifest.load(directory)
    other.splits["train"].shards[1].sha256 = "0" * 64
    with pytest.raises(UserError, match=f"shard {shards[1].file} is corrupted"):
        verify_shards(directory, other)


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("  \n\n")
    with pytest.raises(UserError, match="empty corpus"):
        prepare(_cfg(tmp_path))
    assert not (tmp_path / "data").exists()


def test_order_is_a_permutation_per_epoch_that_differs_between_epochs():
    order = SequenceOrder([1000, 5000, 300, 2048, 7], seq_len=16, seed=3, window=2)
    for epoch in range(3):
        start = sum(order.epoch_size(e) for e in range(epoch))
        seen = [order.locate(p) for p in range(start, start + order.epoch_size(epoch))]
        assert len(set(seen)) == len(seen)
        for shard, first in seen:  # every sequence lies inside its shard
            assert first + 17 <= [1000, 5000, 300, 2048, 7][shard]
    e0 = [order.locate(p) for p in range(50)]
    e1 = [order.locate(order.epoch_size(0) + p) for p in range(50)]
    assert e0 != e1
    same_seed = SequenceOrder([1000, 5000, 300, 2048, 7], seq_len=16, seed=3, window=2)
    assert [same_seed.locate(p) for p in range(0, 2000, 7)] == [
        order.locate(p) for p in range(0, 2000, 7)
    ]
    other_seed = SequenceOrder([1000, 5000, 300, 2048, 7], seq_len=16, seed=4, window=2)
    assert [other_seed.locate(p) for p in range(50)] != e0


def test_too_short_training_split_is_refused():
    with pytest.raises(UserError, match="training split too small: 10 tokens"):
        SequenceOrder([10], seq_len=16, seed=0)


def test_an_order_may_begin_with_empty_epochs():
    # One shard of 20 tokens, sequences of 17: only epoch offsets 0-3 leave room for one.
    seed = next(s for s in range(100) if SequenceOrder([20], seq_len=16, seed=s).epoch_size(0) == 0)
    order = SequenceOrder([20], seq_len=16, seed=seed)
    located = [order.locate(p) for p in range(3)]
    assert all(shard == 0 and first + 17 <= 20 for shard, first in located)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_worker_slices_partition_every_global_batch(world):
    parts = [WorkerSlice(r, world, 16).positions(5, 3) for r in range(world)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(5 * 16, 8 * 16))


def test_validation_set_is_fixed():
    starts = validation_starts([100, 50], seq_len=16, limit=None)
    assert starts[:2] == [(0, 0), (0, 16)] and len(starts) == 6 + 3
    assert validation_starts([100, 50], seq_len=16, limit=4) == starts[:4]
    with pytest.raises(UserError, match="validation split too small"):
        validation_starts([16, 16], seq_len=16, limit=None)


def test_a_worker_streams_its_share_in_order_without_deprecation_warnings(tmp_path):
    import ray.data

    (tmp_path / "corpus.txt").write_text(TEXT)
    prepared = prepare(_cfg(tmp_path), progress=False)
    directory, manifest = prepared.directory, prepared.manifest
    order = SequenceOrder([s.tokens for s in manifest.splits["train"].shards], seq_len=16, seed=5)
    part = WorkerSlice(rank=1, world_size=2, global_batch=8)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("ray.data").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            batches = list(
                stream_train_batches(directory, manifest, order, part, 2, first_step=3, end_step=21)
            )
    finally:
        logging.getLogger("ray.data").removeHandler(handler)
    messages = [r.getMessage() for r in logged] + [str(w.message) for w in warned]
    assert not [m for m in messages if "deprecated" in m.lower()]
    positions = np.concatenate([p for p, _ in batches])
    assert positions.tolist() == part.positions(3, 18).tolist()  # every one, in order
    shards = [read_shard(directory, s) for s in manifest.splits["train"].shards]
    for position, tokens in zip(positions, np.concatenate([t for _, t in batches]), strict=True):
        shard, first = order.locate(int(position))
        assert tokens.tolist() == shards[shard][first : first + 17].tolist()
    # The pipeline's settings stay on its own dataset: the process's context is untouched.
    assert not ray.data.DataContext.get_current().execution_options.preserve_order


def test_a_shard_corrupted_under_a_worker_stream_is_refused_as_itself(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    prepared = prepare(_cfg(tmp_path), progress=False)
    shards = prepared.manifest.splits["train"].shards
    path = Path(prepared.directory) / shards[0].file
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")
    order = SequenceOrder([s.tokens for s in shards], seq_len=16, seed=5, window=len(shards))
    part = WorkerSlice(rank=0, world_size=1, global_batch=8)
    with pytest.raises(UserError) as raised:
        list(stream_train_batches(prepared.directory, prepared.manifest, order, part, 8, 0, 4))
    assert type(raised.value) is UserError  # not Ray Data's wrapper of it
    assert (
        str(raised.value)
        == f"shard {shards[0].file} is corrupted: checksum mismatch with the manifest"
    )


DOCS = [
    "first document, plain ASCII.",
    "第二个文档：中文与表情 🎉🚀",
    "third: naïve café ÆØÅ",
    "fourth 🐍 def f(): pass",
]


def _write_formats(folder: Path) -> None:
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"body": DOCS[1], "id": 1}, ensure_ascii=False) + "\n")
    with pa.CompressedOutputStream(str(folder / "c.jsonl.zst"), "zstd") as f:
        f.write((json.dumps({"body": DOCS[2]}) + "\n").encode())
    pq.write_table(pa.table({"body": [DOCS[3]], "other": [7]}), folder / "d.parquet")


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_prepare_reads_txt_jsonl_gz_zst_and_parquet(tmp_path, kind):
    _write_formats(tmp_path / "in")
    cfg = DataConfig(
        sources=[str(tmp_path / "in")],
        cache_dir=str(tmp_path / "data"),
        text_field="body",
        val_fraction=0.05,
        tokenizer={"kind": kind, "vocab_size": 300},
    )
    prepared = prepare(cfg, progress=False)
    manifest = prepared.manifest
    assert manifest.documents == 4 and len(manifest.inputs) == 4
    tok = load_tokenizer(prepared.directory)
    stream = np.concatenate(
        [
            read_shard(prepared.directory, s)
            for split in ("train", "val")
            for s in manifest.splits[split].shards
        ]
    )
    pieces = np.split(stream, np.nonzero(stream == manifest.eot_id)[0] + 1)[:-1]
    assert [tok.decode(p[:-1].tolist()) for p in pieces] == DOCS  # input order, exact round trip


def test_jsonl_without_the_text_field_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"content": "hello"}\n')
    cfg = DataConfig(sources=[str(tmp_path / "x.jsonl")], cache_dir=str(tmp_path / "data"))
    with pytest.raises(UserError, match="line 1: no 'text' field; set data.text_field"):
        prepare(cfg, progress=False)
    assert not (tmp_path / "data").exists()


def test_missing_and_broken_inputs_are_refused(tmp_path):
    with pytest.raises(UserError, match="input not found"):
        prepare(DataConfig(sources=[str(tmp_path / "nope.txt")], cache_dir=str(tmp_path / "d")))
    (tmp_path / "link.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(UserError, match="input not found"):
        prepare(DataConfig(sources=[str(tmp_path / "link.txt")], cache_dir=str(tmp_path / "d")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no text"):
        prepare(DataConfig(sources=[str(tmp_path / "empty")], cache_dir=str(tmp_path / "d")))
    with pytest.raises(UserError, match="not a prepared dataset"):
        prepare(DataConfig(prepared=str(tmp_path / "empty")))


def test_published_data_is_never_changed_by_a_failed_run(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    first = prepare(_cfg(tmp_path))
    before = {p.name: p.read_bytes() for p in Path(first.directory).iterdir()}
    (tmp_path / "corpus.txt").write_text("   ")
    with pytest.raises(UserError, match="empty corpus"):
        prepare(_cfg(tmp_path))
    assert {p.name: p.read_bytes() for p in Path(first.directory).iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [Path(first.directory).name]


def test_file_uri_inputs_and_outputs(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    cfg = DataConfig(sources=[f"file://{tmp_path}/*.txt"], cache_dir=f"file://{tmp_path}/remote")
    prepared = prepare(cfg, progress=False)
    assert prepared.directory.startswith("file://")
    tokens = read_shard(prepared.directory, prepared.manifest.splits["train"].shards[0])
    assert len(tokens) == prepared.manifest.splits["train"].shards[0].tokens
    assert not prepare(cfg, progress=False).created


def test_char_alphabet_follows_the_byte_cap(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("abcabc " * 100)
    (tmp_path / "in" / "b.txt").write_text("☃ snowmen beyond the cap ☃")
    cfg = DataConfig(
        sources=[str(tmp_path / "in")],
        cache_dir=str(tmp_path / "data"),
        max_source_bytes=710,
        tokenizer={"kind": "char"},
    )
    prepared = prepare(cfg, progress=False)
    assert prepared.manifest.documents == 1
    assert load_tokenizer(prepared.directory).chars == [" ", "a", "b", "c"]
