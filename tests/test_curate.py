"""`data.curate` (data/curate/): each quality rule on hand-made cases, PII scrubbing, near-
duplicate detection against the LSH S-curve on planted pairs of known Jaccard similarity, the
same removals whatever the block count, and `prepare` with every stage on a corpus with planted
duplicates, junk and addresses: what it removed, per rule, and the stream it kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from raytrain_lm.config import DataConfig
from raytrain_lm.config.curate import CurateConfig, NearDedupConfig, PiiConfig, QualityConfig
from raytrain_lm.data.curate.pii import scrub
from raytrain_lm.data.curate.quality import first_failed_rule

GOOD = """Rivers carve their valleys over thousands of years, and the stones they carry tell the story of every flood.
A geologist who walks along the bank can read that history in the layers of sand and gravel.
Some layers are thin and fine, left by slow water in dry summers.
Others are thick and coarse, the work of a single storm that moved boulders with ease.
Together they form a record that is older than any written book, and it is still being written today.
"""  # noqa: E501
LINES = GOOD.strip().splitlines()
RULE_OFF = dict(
    max_duplicate_line_fraction=1.0,
    max_duplicate_line_char_fraction=1.0,
    max_duplicate_paragraph_fraction=1.0,
    max_duplicate_paragraph_char_fraction=1.0,
)

CASES = {
    "words": ("Rivers carve valleys and the stones tell the story of the flood.", {}),
    "mean_word_length": (" ".join(["a to be of it"] * 12) + ".", {}),
    "symbols": (GOOD + " ".join(["#"] * 12), {}),
    "bullets": ("\n".join(f"- {line}" for line in LINES) + "\n", {}),
    "ellipsis_lines": ("\n".join(f"{line[:-1]}…" for line in LINES[:2]) + "\n" + "\n".join(LINES[2:]), {}),  # noqa: E501
    "alpha_words": (GOOD + " ".join(str(1000 + i) for i in range(25)), {}),
    "stop_words": (GOOD.replace(" the ", " a ").replace(" and ", " plus ").replace(" of ", " from ")
                   .replace(" that ", " which ").replace(" with ", " by ").replace(" to ", " in "), {}),  # noqa: E501
    "duplicate_lines": ("\n".join([*LINES, LINES[2], LINES[2], LINES[2]]) + "\n", {}),
    "duplicate_line_chars": ("\n".join([*LINES, LINES[0], LINES[4]]) + "\n", {"max_duplicate_line_fraction": 1.0}),  # noqa: E501
    "duplicate_paragraphs": ("\n\n".join([GOOD, GOOD]), {**RULE_OFF, "max_duplicate_paragraph_fraction": 0.3}),  # noqa: E501
    "duplicate_paragraph_chars": ("\n\n".join([GOOD, GOOD, LINES[0], LINES[1], LINES[2]]), {**RULE_OFF, "max_duplicate_paragraph_char_fraction": 0.2}),  # noqa: E501
    "top_ngram": (GOOD + " river stone" * 40 + ".", {}),
    "punctuated_lines": ("\n".join(line.rstrip(".") for line in LINES) + "\n", {}),
}  # fmt: skip


def test_good_prose_passes_every_rule():
    assert first_failed_rule(GOOD, QualityConfig(enabled=True)) is None


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_quality_rule_removes_its_case(rule):
    text, settings = CASES[rule]
    assert first_failed_rule(text, QualityConfig(enabled=True, **settings)) == rule


def test_pii_addresses_are_replaced_and_look_alikes_kept():
    cfg = PiiConfig(enabled=True)
    text = (
        "Write to jane.doe+lists@mail.example.co.uk or ops@example.org; the server is 10.0.0.12 "
        "(and 2001:db8::1). Python 3.11.4, version 1.2.3.4.5, 256.1.1.1, std::vector, a::b, "
        "12:30:45 and user@localhost stay."
    )
    scrubbed, emails, ips = scrub(text, cfg)
    assert (emails, ips) == (2, 2)
    assert "jane.doe" not in scrubbed and "10.0.0.12" not in scrubbed and "db8" not in scrubbed
    for kept in (
        "3.11.4",
        "1.2.3.4.5",
        "256.1.1.1",
        "std::vector",
        "a::b",
        "12:30:45",
        "user@localhost",
    ):  # noqa: E501
        assert kept in scrubbed, kept
    assert scrubbed.count("email@example.com") == 2 and scrubbed.count("192.0.2.1") == 2


# ------------------------------------------------------------------ near duplicates, S-curve

SHINGLES = 200  # word 5-grams per planted document


def _pair(pair: int, similarity: float) -> tuple[str, str]:
    """Two documents of unique words whose 5-gram sets have Jaccard `similarity` (rounded to a
    whole shared count): they share a prefix of k + 4 words, so k shingles."""
    n = SHINGLES + 4
    shared = round(2 * SHINGLES * similarity / (1 + similarity))
    a = [f"{_letters(pair)}a{_letters(i)}" for i in range(n)]
    b = a[: shared + 4] + [f"{_letters(pair)}b{_letters(i)}" for i in range(n - shared - 4)]
    return " ".join(a), " ".join(b)


def _letters(n: int) -> str:
    """`n` in letters (shingling turns every digit into 0)."""
    return "".join(chr(ord("a") + int(d)) for d in str(n))


def _s_curve(s: float, cfg: NearDedupConfig) -> float:
    return 1 - (1 - s**cfg.rows_per_band) ** cfg.bands


def _removed(texts: list[str], cfg: CurateConfig, directory: Path, blocks: int) -> np.ndarray:
    import ray.data

    from raytrain_lm.data.curate.dedup import REMOVED_FILE, find_duplicates, keys_table

    docs = np.arange(len(texts), dtype=np.int64)
    keys = keys_table(docs, np.zeros(len(texts), dtype=np.int64), texts, cfg)
    dataset = ray.data.from_arrow(keys).repartition(blocks)
    directory.mkdir(parents=True)
    find_duplicates(dataset, cfg, str(directory))
    return np.load(directory / REMOVED_FILE)


def test_near_duplicates_follow_the_lsh_s_curve_whatever_the_blocks(tmp_path):
    """Pairs at Jaccard 0.2-0.5 and 0.85-0.95 (14 bands x 8 rows): the share found at each
    similarity is the S-curve's within 3 binomial standard errors; recall at >= 0.85 is at
    least 0.95 and false positives at <= 0.4 at most 1 % (the S-curve gives 5.3 % at exactly
    0.5). One block or four, the same removals; and always the pair's first document kept."""
    cfg = CurateConfig(near_dedup=NearDedupConfig(enabled=True))
    levels = {0.2: 300, 0.3: 300, 0.4: 300, 0.5: 400, 0.85: 300, 0.9: 200, 0.95: 200}
    texts, similarity = [], []
    for s, count in levels.items():
        for _ in range(count):
            texts.extend(_pair(len(similarity), s))
            similarity.append(s)
    removed = _removed(texts, cfg, tmp_path / "four", blocks=4)
    again = _removed(texts, cfg, tmp_path / "one", blocks=1)
    assert removed.tolist() == again.tolist()
    ids = removed[:, 0]
    assert (ids % 2 == 1).all(), "a pair's first document was removed"
    found = np.zeros(len(similarity), dtype=bool)
    found[ids // 2] = True
    similarity = np.array(similarity)
    for s, count in levels.items():
        rate, expected = found[similarity == s].mean(), _s_curve(s, cfg.near_dedup)
        error = math.sqrt(max(expected * (1 - expected), 1 / count) / count)
        assert abs(rate - expected) <= 3 * error, (s, rate, expected)
    assert found[similarity >= 0.85].mean() >= 0.95
    assert found[similarity <= 0.4].mean() <= 0.01


# -------------------------------------------------------------------------- in prepare


def _corpus(folder: Path) -> dict[str, int]:
    """Two sources: prose in 4 JSON Lines files (originals, exact duplicates, duplicates up to
    spacing, near-duplicates with one word changed, junk, e-mail and IP addresses) and one
    Python file (code: the prose rules skip it). Returns what was planted."""
    rng = np.random.default_rng(3)
    words = GOOD.replace(",", "").replace(".", "").split()
    originals = [
        "\n".join(" ".join(rng.choice(words, size=14)) + "." for _ in range(8)) for _ in range(120)
    ]
    planted = originals[:10] + ["  " + d.replace(" ", "   ") for d in originals[10:15]]
    near = []
    for text in originals[15:25]:
        tokens = text.split(" ")
        tokens[3] = "zebra"
        near.append(" ".join(tokens))
    junk = ["Too short.", "- a\n- b\n- c\n" * 20]
    pii = [
        "\n".join(" ".join(rng.choice(words, size=14)) + "." for _ in range(8))
        + f"\nMail ops{i}@example.org from 10.1.2.{i}."
        for i in range(4)
    ]
    documents = originals + planted + near + junk + pii
    (folder / "prose").mkdir(parents=True)
    for part in range(4):  # a duplicate lands in its original's file, after it (120 % 4 == 0)
        with open(folder / "prose" / f"part-{part}.jsonl", "w", encoding="utf-8") as out:
            for text in documents[part::4]:
                out.write(json.dumps({"text": text}) + "\n")
    (folder / "code").mkdir()
    (folder / "code" / "tool.py").write_text(CODE, encoding="utf-8")
    in_order = [text for part in range(4) for text in documents[part::4]]
    keep = [
        d for i, d in enumerate(in_order) if (d in originals or d in pii) and d not in in_order[:i]
    ]
    return {"documents": documents, "kept": keep}


CODE = "def f():\n    return 1\n"


def _curated(tmp_path: Path, cache: str, cap: int | None = None) -> DataConfig:
    everything = {
        "sample_removed": 2,
        "pii": {"enabled": True},
        "quality": {"enabled": True},
        "exact_dedup": {"enabled": True},
        "near_dedup": {"enabled": True},
    }
    return DataConfig(
        sources=[str(tmp_path / "in" / "prose"), str(tmp_path / "in" / "code")],
        cache_dir=str(tmp_path / cache),
        shard_tokens=1024,
        max_source_bytes=cap,
        curate=everything,
    )


def _stream(prepared) -> list[str]:
    """The documents of a byte-tokenized dataset's token stream, in order."""
    from raytrain_lm.data.manifest import read_shard

    manifest = prepared.manifest
    tokens = np.concatenate(
        [
            read_shard(prepared.directory, s)
            for n in ("train", "val")
            for s in manifest.splits[n].shards
        ]
    )
    ends = np.flatnonzero(tokens == manifest.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [
        bytes(tokens[a:b].astype(np.uint8)).decode("utf-8")
        for a, b in zip(starts, ends, strict=True)
    ]


def test_prepare_removes_and_reports_per_rule_and_source(tmp_path, capsys, monkeypatch):
    """Every stage on: the 15 exact duplicates (10 equal, 5 up to spacing) and 10 near ones
    go, each time the later copy; the two junk documents go under the rule each fails; the 4
    documents with an e-mail and an IP address keep their text with both replaced; the code
    file skips the prose rules. The stream is exactly the kept documents in input order, the
    manifest and the printed table count them. With a byte cap that ends the stream inside a
    file, one read task or four give the same shards and counts."""
    from raytrain_lm.data import prepare_job
    from raytrain_lm.data.prepare import prepare

    planted = _corpus(tmp_path / "in")
    prepared = prepare(_curated(tmp_path, "data"), progress=False)
    pii = PiiConfig(enabled=True)
    expected = [scrub(text, pii)[0] for text in planted["kept"]] + [CODE]
    assert _stream(prepared) == expected
    assert prepared.manifest.documents == len(expected)
    prose, code = prepared.manifest.curation["sources"].values()
    assert prose["in"][0] == len(planted["documents"])
    assert {rule: docs for rule, (docs, _) in prose["removed"].items()} == {
        "exact_duplicate": 15,
        "near_duplicate": 10,
        "words": 1,
        "mean_word_length": 1,
    }
    assert prose["pii"] == [4, 4, 4]
    assert prose["kept"][0] == len(expected) - 1
    assert code == {"in": [1, len(CODE)], "pii": [0, 0, 0], "removed": {}, "kept": [1, len(CODE)]}
    printed = capsys.readouterr().out
    assert "removed by exact_duplicate: 15 documents" in printed
    # The first 2 removed documents of each rule, for a human to look at, beside the shards.
    samples = {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()]
        for path in (Path(prepared.directory) / "removed").iterdir()
    }
    assert {rule: len(found) for rule, found in samples.items()} == {
        "exact_duplicate": 2,
        "near_duplicate": 2,
        "words": 1,
        "mean_word_length": 1,
    }
    assert samples["words"] == [{"source": str(tmp_path / "in" / "prose"), "text": "Too short."}]
    originals = {" ".join(text.split()) for text in planted["kept"]}
    assert all(" ".join(e["text"].split()) in originals for e in samples["exact_duplicate"])
    assert "removed by near_duplicate: 10 documents" in printed

    cap = prose["kept"][1] // 3
    capped = prepare(_curated(tmp_path, "capped", cap), progress=False)
    original = prepare_job.ordered_dataset
    monkeypatch.setattr(prepare_job, "ordered_dataset", lambda items, blocks: original(items, 1))
    one_task = prepare(_curated(tmp_path, "capped-one-task", cap), progress=False)
    shards = [s.sha256 for split in capped.manifest.splits.values() for s in split.shards]
    assert [s.sha256 for split in one_task.manifest.splits.values() for s in split.shards] == shards
    assert one_task.manifest.curation == capped.manifest.curation
    assert Path(one_task.directory).name == Path(capped.directory).name  # same fingerprint
    counts = capped.manifest.curation["sources"]
    assert list(counts) == [str(tmp_path / "in" / "prose")]  # the code file is past the cap
    assert 0 < counts[str(tmp_path / "in" / "prose")]["kept"][1] <= cap


def test_a_corpus_curation_empties_is_refused(tmp_path):
    """Every document junk (quality) and the duplicate stages on: the stages run on nothing
    and `prepare` refuses the empty corpus in one line."""
    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.errors import UserError

    junk = ["Too short.", "!!! ???", "- a\n- b"]
    (tmp_path / "junk.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in junk) + "\n")
    curate = {key: {"enabled": True} for key in ("quality", "exact_dedup", "near_dedup")}
    cfg = DataConfig(
        sources=[str(tmp_path / "junk.jsonl")], cache_dir=str(tmp_path / "data"), curate=curate
    )
    with pytest.raises(UserError, match="empty corpus"):
        prepare(cfg, progress=False)


def test_a_partition_links_each_bucket_like_grouping_by_the_key():
    """The grouping functions see a hash partition of many keys at once: they must give what
    grouping by each key would (every bucket's lowest id linked to its others; all but the
    lowest id of each exact key), whatever the rows' order."""
    from raytrain_lm.data.curate.dedup import _bucket_links, _exact_group, _partition_of

    rng = np.random.default_rng(0)
    n = 5_000
    group = {
        "near_scope": rng.integers(0, 2, n),
        "band": rng.integers(0, 3, n),
        "bucket": rng.integers(-40, 40, n) * (2**40),  # many collisions, signed 64-bit values
        "doc": rng.permutation(n).astype(np.int64),
    }
    buckets: dict[tuple, list[int]] = {}
    for scope, band, bucket, doc in zip(*group.values(), strict=True):
        buckets.setdefault((scope, band, bucket), []).append(int(doc))
    expected = {(min(d), x) for d in buckets.values() for x in d if x != min(d)}
    links = _bucket_links(group)
    assert set(zip(links["a"].tolist(), links["b"].tolist(), strict=True)) == expected
    assert len(links["a"]) == len(expected)  # each link once

    exact = {"exact_scope": group["near_scope"], "exact": group["bucket"], "doc": group["doc"]}
    kept = {min(d) for k, d in _keys_docs(exact).items()}
    assert set(_exact_group(exact)["doc"].tolist()) == set(range(n)) - kept
    assert len(_exact_group({k: v[:0] for k, v in exact.items()})["doc"]) == 0

    parts = _partition_of(group["near_scope"], group["band"], group["bucket"], partitions=7)
    assert parts.min() >= 0 and parts.max() < 7 and len(set(parts.tolist())) > 1
    for key, docs in buckets.items():  # a key's rows all in one partition
        rows = np.isin(group["doc"], docs)
        assert len(set(parts[rows].tolist())) == 1, key


def _keys_docs(exact: dict[str, np.ndarray]) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for scope, key, doc in zip(exact["exact_scope"], exact["exact"], exact["doc"], strict=True):
        out.setdefault((scope, key), []).append(int(doc))
    return out
