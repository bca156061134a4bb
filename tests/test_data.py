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

    # A shard modified within a timestamp tick of its check is hashed until it is older (a
    # tick of an hour here: on a loaded machine the next check may come seconds later).
    monkeypatch.setattr(manifest_module, "RACY_NS", 3600 * 10**9)
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


def _jsonl_corpus(folder: Path, files: int = 6, docs: int = 40) -> None:
    """JSON Lines files of documents of varied lengths and scripts, and one plain text file."""
    import json

    rng = np.random.default_rng(7)
    words = ["token", "stream", "naïve", "café", "跳过", "🐕", "shard", "exact", "order", "x"]
    folder.mkdir()
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w", encoding="utf-8") as out:
            for _ in range(docs):
                text = " ".join(rng.choice(words, size=int(rng.integers(1, 60))))
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            out.write(json.dumps({"text": "   "}) + "\n")  # blank: no document
    (folder / "z.txt").write_text("the last document.\n" * 30, encoding="utf-8")


def _reference(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, int]:
    """The token stream `cfg` defines, computed in this process without Ray: every non-blank
    document in input order while their bytes fit under the cap (the first always), each
    encoded and followed by end-of-text; and how many documents that is."""
    from raytrain_lm.data.sources import expand_sources, read_documents

    parts, total, documents = [], 0, 0
    limit = cfg.max_source_bytes
    for item in expand_sources(cfg.sources):
        for doc in read_documents(item, cfg.text_field):
            if not doc.text.strip():
                continue
            size = len(doc.text.encode("utf-8"))
            if limit is not None and total + size > limit and documents:
                return np.concatenate(parts), documents
            parts.append(np.array([*tokenizer.encode(doc.text), tokenizer.eot_id], dtype=np.int64))
            total, documents = total + size, documents + 1
            if limit is not None and total >= limit:
                return np.concatenate(parts), documents
    return np.concatenate(parts), documents


@pytest.mark.parametrize(
    "kind, cap",
    [("byte", None), ("byte", 9000), ("char", 9000), ("bpe", 9000)],
)
def test_the_token_stream_and_its_shards_are_those_of_a_plain_tokenization(tmp_path, kind, cap):
    """Tasks write the pieces and shards; the train and val splits still hold exactly the
    stream a plain in-process tokenization gives, cut where one writer of it would cut."""
    from raytrain_lm.tokenization import BPETokenizer

    _jsonl_corpus(tmp_path / "in")
    tokenizer = {"kind": kind}
    if kind == "bpe":
        BPETokenizer.train([TEXT, "naïve café 跳过 🐕 token stream"], 300).save(tmp_path)
        tokenizer["path"] = str(tmp_path)
    cfg = DataConfig(
        sources=[str(tmp_path / "in")],
        cache_dir=str(tmp_path / "data"),
        shard_tokens=1024,
        val_fraction=0.13,
        max_source_bytes=cap,
        tokenizer=tokenizer,
    )
    prepared = prepare(cfg, progress=False)
    directory, manifest = prepared.directory, prepared.manifest
    tok = load_tokenizer(directory)
    expected, documents = _reference(cfg, tok)
    if cap is not None:  # the cap falls inside a file, i.e. inside one task's group
        assert documents % 40  # 40 documents per file
    if kind == "char":  # the alphabet is that of the documents under the cap
        assert set(tok.chars) == set(tok.decode(expected[expected != tok.eot_id].tolist()))
    splits = {
        name: [read_shard(directory, s) for s in manifest.splits[name].shards]
        for name in ("train", "val")
    }
    stream = np.concatenate(splits["train"] + splits["val"])
    assert stream.tolist() == expected.tolist()
    assert manifest.documents == documents
    total = len(expected)
    n_val = max(int(total * cfg.val_fraction), 2)
    assert manifest.splits["val"].tokens == n_val == sum(len(s) for s in splits["val"])
    # Shards are the stream cut every shard_tokens, the one holding the boundary cut in two.
    boundary = total - n_val
    cuts = sorted({0, boundary, total, *range(1024, total, 1024)})
    sizes = [len(s) for s in splits["train"] + splits["val"]]
    assert sizes == [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [Path(directory).name]
    assert not [p.name for p in Path(directory).iterdir() if p.name.startswith(".")]


def _walk(value, found: list, depth: int = 0) -> None:
    """Collects the arrays and tables in a value (through lists, tuples and dicts)."""
    import pyarrow as pa

    if depth > 4:
        return
    if isinstance(value, np.ndarray | pa.Array | pa.ChunkedArray | pa.Table | pa.RecordBatch):
        found.append(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _walk(item, found, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, found, depth + 1)


def test_the_driver_receives_no_token_arrays(tmp_path, monkeypatch):
    """What `prepare`'s driver iterates and gets back from its tasks is metadata: one small row
    per group of inputs, and the shards' names, sizes and checksums."""
    import pyarrow as pa
    import ray
    import ray.data

    from raytrain_lm.data.manifest import ShardInfo
    from raytrain_lm.data.prepare_tasks import METADATA_COLUMNS

    (tmp_path / "in").mkdir()
    for i in range(8):
        (tmp_path / "in" / f"{i}.txt").write_text(f"file {i}: " + TEXT, encoding="utf-8")
    iterated, got = [], []
    real_iter_batches, real_get = ray.data.Dataset.iter_batches, ray.get

    def iter_batches(self, *args, **kwargs):
        for batch in real_iter_batches(self, *args, **kwargs):
            iterated.append(batch)
            yield batch

    def get(refs, *args, **kwargs):
        values = real_get(refs, *args, **kwargs)
        got.append(values)
        return values

    monkeypatch.setattr(ray.data.Dataset, "iter_batches", iter_batches)
    monkeypatch.setattr(ray, "get", get)
    cfg = DataConfig(
        sources=[str(tmp_path / "in")],
        cache_dir=str(tmp_path / "data"),
        shard_tokens=4096,
        max_source_bytes=None,
    )
    prepared = prepare(cfg, progress=False)
    monkeypatch.undo()
    manifest = prepared.manifest
    tokens = manifest.splits["train"].tokens + manifest.splits["val"].tokens
    assert tokens > 100_000 and len(manifest.splits["train"].shards) > 20
    assert iterated and all(isinstance(b, pa.Table) for b in iterated)
    assert all(tuple(b.column_names) == METADATA_COLUMNS for b in iterated)
    assert sum(b.num_rows for b in iterated) == 8  # a row per group: here, per file
    assert sum(b.nbytes for b in iterated) < 2000
    arrays: list = []
    _walk(got, arrays)
    assert all(len(a) < 100 for a in arrays), [type(a) for a in arrays if len(a) >= 100]
    shard_infos = [
        i for v in got if isinstance(v, list) for w in v if isinstance(w, list) for i in w
    ]
    shards = [s for n in ("train", "val") for s in manifest.splits[n].shards]
    assert len(shard_infos) == len(shards)
    assert all(isinstance(i, ShardInfo) for i in shard_infos)
    stream = np.concatenate([read_shard(prepared.directory, s) for s in shards])
    expected, _ = _reference(cfg, load_tokenizer(prepared.directory))
    assert stream.tolist() == expected.tolist()
