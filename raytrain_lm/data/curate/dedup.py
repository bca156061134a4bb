"""Exact and near-duplicate removal (`data.curate.exact_dedup`, `data.curate.near_dedup`): a pass
of Ray Data stages over the documents that PII scrubbing and the quality rules kept, run before
tokenizing. It writes which documents are duplicates to one file beside the pieces, which the
reading tasks then consult (prepare_tasks.read_group).

1. Keys (a map over the groups of inputs): per document, its id (input index and ordinal, the
   same in every pass), its source, a hash of its normalised text (exact) and the hashes of its
   MinHash signature's LSH bands (near). Signatures are rensa's (Rust; measured about 100x
   datasketch's speed here) over word n-grams of the text lowercased, without punctuation,
   numbers as 0.
2. Exact: documents with the same (scope, hash); all but the lowest id of each are duplicates.
3. Near, on the documents the exact stage kept: one row per (document, band); the rows of the
   same (scope, band, band hash), a bucket, link their documents; the connected components of
   those links are clusters, of which all but the lowest id are near-duplicates (datatrove's
   MinHash stages do the same, with the clustering in one task).
4. One Ray task takes the duplicates of both and writes the file: sorted ids and the rule.

Stages 2 and 3 group by a partition of the key's hash (Ray Data's `groupby`, a shuffle that
scales out), not by the key itself: each group is then a sorted NumPy pass over many keys.
Grouped by the key, nearly every group was one row and a Python call of its own, and those
calls were most of the pass (about 0.45 ms a document for its 14 bands).

Every decision depends on documents' ids and content only: the same removals whatever the block
count or the number of nodes.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import unicodedata

import numpy as np
import pyarrow as pa

from raytrain_lm import storage
from raytrain_lm.config.curate import CurateConfig, NearDedupConfig

REMOVED_FILE = "duplicates.npy"
EXACT_FILE = "exact-duplicates.npy"
_PUNCTUATION = re.compile(r"[^\w\s]|_", re.UNICODE)
_NUMBERS = re.compile(r"\d+")
_SPACES = re.compile(r"\s+")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def exact_key(text: str) -> int:
    """A 64-bit hash of the text with Unicode normalised (NFC) and runs of whitespace as one
    space, trimmed: documents equal up to spacing share it."""
    normal = _SPACES.sub(" ", unicodedata.normalize("NFC", text)).strip()
    return _hash64(normal.encode("utf-8"))


def shingles(text: str, n: int) -> list[str]:
    """The word n-grams of the text simplified as FineWeb's deduplication does (lowercase, no
    punctuation, each number as 0, whitespace collapsed); a shorter text is one shingle."""
    simple = _NUMBERS.sub("0", _PUNCTUATION.sub(" ", unicodedata.normalize("NFKC", text).lower()))
    words = simple.split()
    if not words:
        return []
    if len(words) <= n:
        return [" ".join(words)]
    return [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]


def band_keys(text: str, cfg: NearDedupConfig) -> list[int]:
    """The 64-bit hash of each LSH band of the text's MinHash signature; none for a text
    without words (all punctuation), which would otherwise match every other such text."""
    from rensa import RMinHash

    grams = shingles(text, cfg.ngram)
    if not grams:
        return []
    minhash = RMinHash(num_perm=cfg.bands * cfg.rows_per_band, seed=cfg.seed)
    minhash.update(grams)
    rows = np.asarray(minhash.digest(), dtype=np.uint32).reshape(cfg.bands, cfg.rows_per_band)
    return [_hash64(band.tobytes()) for band in rows]


def _scope(sources: np.ndarray, scope: str) -> np.ndarray:
    return sources if scope == "source" else np.zeros_like(sources)


def keys_table(docs: np.ndarray, sources: np.ndarray, texts: list[str], cfg: CurateConfig):
    """The keys of the kept documents of one group (stage 1)."""
    near = cfg.near_dedup
    exact = [exact_key(t) for t in texts] if cfg.exact_dedup.enabled else [0] * len(texts)
    bands = [band_keys(t, near) for t in texts] if near.enabled else [[]] * len(texts)
    return pa.table(
        {
            "doc": pa.array(docs, type=pa.int64()),
            "exact_scope": pa.array(_scope(sources, cfg.exact_dedup.scope), type=pa.int64()),
            "near_scope": pa.array(_scope(sources, near.scope), type=pa.int64()),
            "exact": pa.array(exact, type=pa.int64()),
            "bands": pa.array(bands, type=pa.list_(pa.int64())),
        }
    )


ROWS_PER_REDUCER = 2_000_000  # keys one shuffle reducer holds (about 100 MB)
PARTS_PER_REDUCER = 16  # Ray hashes the part values onto reducers: many each, for balance


def _partition_of(*keys: np.ndarray, partitions: int) -> np.ndarray:
    """Which group a key goes to: a mix of its columns, its high half modulo `partitions`
    (equal keys, equal partition; unsigned arithmetic wraps)."""
    mixed = np.zeros(len(keys[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in keys:
            mixed = (mixed ^ column.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
    return ((mixed >> np.uint64(32)) % np.uint64(partitions)).astype(np.int64)


def _firsts_and_rest(keys: list[np.ndarray], docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by key then id: for every row that is not its key's first (lowest id), that
    first id and its own id."""
    if not len(docs):
        return docs, docs
    order = np.lexsort((docs, *reversed(keys)))
    docs = docs[order]
    same = np.ones(len(docs), dtype=bool)
    same[0] = False
    for column in keys:
        column = column[order]
        same[1:] &= column[1:] == column[:-1]
    run_start = np.maximum.accumulate(np.where(~same, np.arange(len(docs)), 0))
    return docs[run_start][same], docs[same]


def _exact_group(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All but the lowest id of each (scope, hash) in this partition."""
    _, rest = _firsts_and_rest([group["exact_scope"], group["exact"]], group["doc"])
    return {"doc": np.unique(rest)}


def _exact_rows(batch: pa.Table, partitions: int) -> pa.Table:
    """What the exact stage groups: scope, hash and id (not the bands), and the partition."""
    rows = batch.select(["exact_scope", "exact", "doc"])
    keys = [rows.column(name).to_numpy() for name in ("exact_scope", "exact")]
    return rows.append_column("part", pa.array(_partition_of(*keys, partitions=partitions)))


def _bucket_rows(batch: pa.Table, partitions: int) -> pa.Table:
    """One row per (document, band): its scope, the band's index and hash, and its partition."""
    lengths = np.array([len(b) for b in batch.column("bands").to_pylist()], dtype=np.int64)
    flat = batch.column("bands").combine_chunks().flatten().to_numpy()
    index = np.concatenate([np.arange(n) for n in lengths] or [np.zeros(0, np.int64)])
    scope = np.repeat(batch.column("near_scope").to_numpy(), lengths)
    return pa.table(
        {
            "near_scope": scope,
            "band": index.astype(np.int64),
            "bucket": flat,
            "doc": np.repeat(batch.column("doc").to_numpy(), lengths),
            "part": _partition_of(scope, index, flat, partitions=partitions),
        }
    )


def _bucket_links(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each bucket of this partition links its lowest id to each of its other ids."""
    keys = [group["near_scope"], group["band"], group["bucket"]]
    first, rest = _firsts_and_rest(keys, group["doc"])
    links = np.unique(np.stack([first, rest], axis=1)[first != rest], axis=0)
    return {"a": links[:, 0].copy(), "b": links[:, 1].copy()}


def _reducers(rows: int, cpus: int) -> int:
    return max(2 * cpus, -(-rows // ROWS_PER_REDUCER))


def find_duplicates(keys, cfg: CurateConfig, directory: str) -> dict[str, int]:
    """Stages 2-4 on the keys dataset; writes REMOVED_FILE under `directory` and returns how
    many documents each rule removed (the tally counts them per source later). The near stage
    sees only the documents the exact stage kept, as if it ran on its output."""
    import ray

    # Computed once for both stages (they would each run the reading pass again), and
    # counted: Ray Data cannot group an empty dataset.
    keys = keys.materialize()
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    exact_path = storage.join(directory, EXACT_FILE) if cfg.exact_dedup.enabled else None
    if exact_path is not None:
        refs = []
        if count := keys.count():
            reducers = _reducers(count, cpus)
            exact = keys.map_batches(
                _exact_rows,
                fn_kwargs={"partitions": reducers * PARTS_PER_REDUCER},
                batch_format="pyarrow",
            ).groupby("part", num_partitions=reducers)
            refs = exact.map_groups(_exact_group, batch_format="numpy").to_arrow_refs()
        write = ray.remote(num_cpus=1)(_write_exact)
        ray.get(write.remote(exact_path, *refs))
    link_refs: list = []
    if cfg.near_dedup.enabled:
        survivors = keys
        if exact_path is not None:
            survivors = keys.map_batches(
                _without_exact, fn_kwargs={"path": exact_path}, batch_format="pyarrow"
            )
        # Partitions for 14 rows per document (near_dedup.bands: at most that many).
        reducers = _reducers(keys.count() * cfg.near_dedup.bands, cpus)
        rows = survivors.map_batches(
            _bucket_rows,
            fn_kwargs={"partitions": reducers * PARTS_PER_REDUCER},
            batch_format="pyarrow",
            batch_size=None,
        )
        rows = rows.materialize()
        if rows.count():
            links = rows.groupby("part", num_partitions=reducers)
            link_refs = links.map_groups(_bucket_links, batch_format="numpy").to_arrow_refs()
    path = storage.join(directory, REMOVED_FILE)
    resolve = ray.remote(num_cpus=1)(_resolve_duplicates)
    return ray.get(resolve.remote(path, exact_path, *link_refs))


def _column(tables: tuple[pa.Table, ...], name: str) -> np.ndarray:
    """A column of blocks concatenated; blocks of an empty dataset may have no columns."""
    parts = [t.column(name).to_numpy() for t in tables if t.num_rows]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _save(path: str, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array.astype(np.int64))
    storage.write_bytes(path, buffer.getvalue())


def _load(path: str) -> np.ndarray:
    return np.load(io.BytesIO(storage.read_bytes(path)))


def _write_exact(path: str, *tables: pa.Table) -> None:
    """Stage 2's end (a Ray task): the exact duplicates' ids, sorted, in one file."""
    _save(path, np.unique(_column(tables, "doc")))


def _without_exact(batch: pa.Table, path: str) -> pa.Table:
    return batch.filter(pa.array(~np.isin(batch.column("doc").to_numpy(), _load(path))))


def _resolve_duplicates(path: str, exact_path: str | None, *links: pa.Table) -> dict[str, int]:
    """Stage 4 (a Ray task): the clusters of the near-duplicate links (connected components;
    each keeps its lowest id) and the exact duplicates, into one sorted file of (id, rule)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    from raytrain_lm.data.curate.stages import EXACT_DUPLICATE, NEAR_DUPLICATE

    exact = _load(exact_path) if exact_path is not None else np.zeros(0, dtype=np.int64)
    a, b = _column(links, "a"), _column(links, "b")
    near = np.zeros(0, dtype=np.int64)
    if len(a):
        nodes, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
        graph = coo_matrix(
            (np.ones(len(a)), (inverse[: len(a)], inverse[len(a) :])),
            shape=(len(nodes), len(nodes)),
        )
        _, labels = connected_components(graph, directed=False)
        lowest = np.full(labels.max() + 1, np.iinfo(np.int64).max)
        np.minimum.at(lowest, labels, nodes)
        near = nodes[nodes != lowest[labels]]
    docs = np.concatenate([exact, near])
    rules = np.concatenate(
        [np.full(len(exact), EXACT_DUPLICATE), np.full(len(near), NEAR_DUPLICATE)]
    )
    order = np.argsort(docs, kind="stable")
    _save(path, np.stack([docs[order], rules[order]], axis=1).reshape(-1, 2))
    return {"exact_duplicate": len(exact), "near_duplicate": len(near)}


@functools.lru_cache(maxsize=2)
def load_duplicates(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(sorted ids, their rule codes) from REMOVED_FILE; read once per process."""
    table = np.load(io.BytesIO(storage.read_bytes(path)))
    return table[:, 0].copy(), table[:, 1].copy()


def duplicate_rules(docs: np.ndarray, path: str) -> np.ndarray:
    """For each id of `docs`, its duplicate rule code, or -1."""
    ids, rules = load_duplicates(path)
    if not len(ids):
        return np.full(len(docs), -1, dtype=np.int64)
    where = np.minimum(np.searchsorted(ids, docs), len(ids) - 1)
    return np.where(ids[where] == docs, rules[where], -1)
