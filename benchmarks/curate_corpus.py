"""The corpus and CPU meter of benchmarks/curate_vs_datatrove.py (its docstring describes the
corpus), apart so that the script stays under 500 lines and so that datatrove's virtualenv,
which has neither raytrain_lm nor torch nor Ray, can import them: standard library only at
module level (numpy is imported inside write_corpus, which only the project's interpreter
calls)."""

from __future__ import annotations

import json
import os
from pathlib import Path

EDIT_LEVELS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.10, 0.20)  # share of words replaced (0: exact)
NGRAM, BANDS, ROWS = 5, 14, 8


class CpuMeter:
    """User + system CPU seconds of this process and its descendants while inside the `with`
    (Linux /proc, polled every `period` seconds from a thread): a process that exits loses at
    most its last `period` of CPU, one that lives less than `period` is missed. Polling
    rather than the processes' totals at the end because pools' workers exit before then and
    not every parent reaps them (Ray's actors)."""

    def __init__(self, period: float = 0.25):
        import threading

        self.period = period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.seconds = 0.0

    @staticmethod
    def _scan() -> dict[tuple[int, int], float]:
        """(pid, start time) -> CPU seconds, for this process and its live descendants."""
        tick = os.sysconf("SC_CLK_TCK")
        parents: dict[int, int] = {}
        cpu: dict[int, tuple[int, float]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            parents[int(entry)] = int(fields[1])
            cpu[int(entry)] = (int(fields[19]), (int(fields[11]) + int(fields[12])) / tick)
        mine = {os.getpid()}
        grew = True
        while grew:
            before = len(mine)
            mine |= {pid for pid, parent in parents.items() if parent in mine}
            grew = len(mine) > before
        return {(pid, cpu[pid][0]): cpu[pid][1] for pid in mine if pid in cpu}

    def _poll(self) -> None:
        while not self.stop.wait(self.period):
            self.last.update(self._scan())

    def __enter__(self) -> CpuMeter:
        self.base = self._scan()
        self.last = dict(self.base)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.last.update(self._scan())
        self.seconds = sum(v - self.base.get(k, 0.0) for k, v in self.last.items())


def write_corpus(folder: Path, originals: int, clusters: int, files: int, seed: int = 0) -> dict:
    """The corpus (module docstring) in `files` JSON Lines files; returns the ground truth:
    per document (in the final order) its cluster (-1: none), the edit level of a copy (-1:
    an original or unique), its Jaccard to its original, and the files' document counts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, 27)
    weights /= weights.sum()
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < 50_000:
        for n in rng.integers(3, 11, size=60_000):
            word = "".join(rng.choice(letters, size=n, p=weights))
            if word not in seen:
                seen.add(word)
                vocab.append(word)
                if len(vocab) == 50_000:
                    break
    ranks = 1.0 / np.arange(1, len(vocab) + 1)
    ranks /= ranks.sum()
    cdf = np.cumsum(ranks)

    def draw(n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cdf, rng.random(n)), len(vocab) - 1)

    # A document: word indices, and where sentences and paragraphs end (kept by its copies).
    bodies = []
    for _ in range(originals):
        n = int(rng.integers(200, 501))
        cuts = np.cumsum(rng.integers(6, 21, size=n // 6 + 1))
        cuts = cuts[cuts < n]
        paragraph = rng.random(len(cuts)) < 0.15
        comma = rng.random(n) < 0.04
        bodies.append((draw(n), cuts, paragraph, comma))

    docs = [(i, -1, -1) for i in range(originals)]  # (body, cluster, level index)
    copies: list[tuple[int, np.ndarray]] = []  # per copy: its words
    seeds = rng.choice(originals, size=clusters, replace=False)
    for c, original in enumerate(seeds):
        docs[original] = (original, c, -1)
        for _ in range(int(rng.integers(1, 4))):
            level = int(rng.integers(len(EDIT_LEVELS)))
            words = bodies[original][0].copy()
            k = int(round(EDIT_LEVELS[level] * len(words)))
            where = rng.choice(len(words), size=k, replace=False)
            words[where] = draw(k)
            copies.append((original, words))
            docs.append((originals + len(copies) - 1, c, level))

    def words_of(body: int) -> np.ndarray:
        return bodies[body][0] if body < originals else copies[body - originals][1]

    def render(body: int) -> str:
        original = body if body < originals else copies[body - originals][0]
        _, cuts, paragraph, comma = bodies[original]
        words = [vocab[w] for w in words_of(body)]
        for i in np.flatnonzero(comma):
            words[i] += ","
        out, start = [], 0
        for cut, para in zip([*cuts, len(words)], [*paragraph, False], strict=True):
            sentence = " ".join(words[start:cut]).rstrip(",")
            out.append(sentence[:1].upper() + sentence[1:] + "." + ("\n\n" if para else " "))
            start = cut
        return "".join(out).strip()

    def grams(body: int) -> set:
        w = words_of(body).tolist()
        return {tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1)}

    order = rng.permutation(len(docs))
    first: dict[int, int] = {}  # cluster -> position of its earliest member
    for position, d in enumerate(order):
        cluster = docs[d][1]
        if cluster >= 0 and cluster not in first:
            first[cluster] = position
    for position, d in enumerate(order):  # put each original where its cluster starts
        body, cluster, level = docs[d]
        if cluster >= 0 and level == -1 and first[cluster] != position:
            other = first[cluster]
            order[position], order[other] = order[other], order[position]
    truth = {"cluster": [], "level": [], "jaccard": [], "file_docs": []}
    folder.mkdir(parents=True)
    per_file = -(-len(docs) // files)
    for f in range(files):
        part = order[f * per_file : (f + 1) * per_file]
        truth["file_docs"].append(len(part))
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            for d in part:
                body, cluster, level = docs[d]
                gid = len(truth["cluster"])
                out.write(json.dumps({"id": str(gid), "text": render(body)}) + "\n")
                truth["cluster"].append(cluster)
                truth["level"].append(level)
                if level >= 0:
                    a, b = grams(body), grams(copies[body - originals][0])
                    truth["jaccard"].append(len(a & b) / len(a | b))
                else:
                    truth["jaccard"].append(-1.0)
    return truth
