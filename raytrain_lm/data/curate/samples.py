"""A sample of what curation removed, for a human to look at (`data.curate.sample_removed`):
the first N removed documents of each rule, in input order, written beside the shards as
`removed/<rule>.jsonl` (one JSON object a line: source, text).

Each reading task writes its group's first N of each rule beside its piece; the driver, taking
the groups in order, reads those files only while a rule still lacks documents, and never past
the byte cap's end of the stream: a bounded amount of text, the same whatever the grouping."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from raytrain_lm import storage
from raytrain_lm.data.curate.stages import ALL_RULES, KEPT, RECORD

SAMPLE_DIR = "removed"


def write_sample(
    documents: pa.Table, records: np.ndarray, count: int, pieces: str, group: int
) -> str | None:
    """Writes the group's first `count` removed documents of each rule (with their place in
    the group) beside the pieces; returns the file's location, or None when none was removed."""
    rules = records[:, RECORD.index("rule")]
    chosen = [
        i for code in np.unique(rules[rules != KEPT]) for i in np.flatnonzero(rules == code)[:count]
    ]
    if not chosen:
        return None
    texts = documents.column("text")
    lines = [
        json.dumps(
            {
                "rule": ALL_RULES[int(rules[i])],
                "place": int(i),
                "source": int(records[i, RECORD.index("source")]),
                "text": texts[int(i)].as_py(),
            },
            ensure_ascii=False,
        )
        for i in sorted(chosen)
    ]
    path = storage.join(pieces, f"removed-{group:08d}.jsonl")
    storage.write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return path


class RemovedSample:
    """The driver's side: the first `count` removed documents of each rule, over the groups."""

    def __init__(self, count: int, sources: list[str]):
        self.count, self.sources = count, sources
        self.by_rule: dict[str, list[dict]] = {}

    def add(self, path: str | None, tally: dict[str, dict], read: int | None = None) -> None:
        """The group's sample at `path`, whose tally is `tally`, up to its first `read`
        documents (None: all of them)."""
        wanted = {rule for counts in tally.values() for rule in counts["removed"]}
        if path is None or all(len(self.by_rule.get(r, ())) >= self.count for r in wanted):
            return
        for line in storage.read_bytes(path).decode("utf-8").splitlines():
            entry = json.loads(line)
            taken = self.by_rule.setdefault(entry["rule"], [])
            if (read is None or entry["place"] < read) and len(taken) < self.count:
                taken.append({"source": self.sources[entry["source"]], "text": entry["text"]})

    def write(self, directory: str) -> None:
        if self.by_rule:
            storage.makedirs(storage.join(directory, SAMPLE_DIR))  # a folder; none on a bucket
        for rule, entries in sorted(self.by_rule.items()):
            lines = [json.dumps(e, ensure_ascii=False) for e in entries]
            path = storage.join(directory, SAMPLE_DIR, f"{rule}.jsonl")
            storage.write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
