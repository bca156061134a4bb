"""How `prepare` scales with tokenizing nodes (issue 15.3), and how it compares with bare
`encode_batch` in one process.

A local multi-node Ray (`ray.cluster_utils.Cluster`, every node on this machine): a head with
no CPUs (the driver's node; it schedules and receives metadata, never tokens) and n worker
nodes of 1 logical CPU each, n = 1, 2, 4 (nodes are added between measurements). The corpus
is generated (no downloads): `--mb` MB of synthetic English-like JSON Lines in 1 MB files.
Byte-level BPE (vocab 4096) is trained once beforehand on a 2 MB sample and passed as
`data.tokenizer.path`, so every prepare tokenizes with the same tokenizer and none trains.

Timed: the whole `prepare()` call once the cluster is up (listing and fingerprinting the
inputs, loading the tokenizer, the Ray Data job in which tasks read, tokenize and write
pieces, the tasks that cut the pieces into shards with checksums, the manifest). A small
prepare on the same nodes runs first and is not timed (it starts the nodes' worker
processes). tokens/s(n) is the median over `--rounds`; efficiency(n) = tokens/s(n) / (n x
tokens/s(1)), goal >= 0.8.

Baseline: HF `tokenizers` `encode_batch` (256 documents per call) on the same documents
already in memory, same tokenizer file, one thread (`TOKENIZERS_PARALLELISM=false`), in this
process: what one CPU does without Ray, reading no files. Ratio = prepare's tokens/s on 1 node
/ the baseline's, goal >= 0.8. Both must count the same tokens (asserted).

Read the result against the machine: n logical CPUs on fewer physical cores cannot scale
linearly; the script prints the machine's physical core count next to the figures.

    .venv/bin/python benchmarks/prepare_scaling.py [--mb 16] [--rounds 2] [--nodes 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except ImportError:
        return None


def write_corpus(folder: Path, megabytes: int, seed: int = 0) -> None:
    """`megabytes` MB of JSON Lines in 1 MB files: documents of 50-400 words drawn from a
    Zipf-distributed vocabulary of 20,000 pseudo-words, with punctuation and line breaks."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, 27)
    weights /= weights.sum()
    lengths = rng.integers(2, 10, size=20_000)
    words = np.array(["".join(rng.choice(letters, size=n, p=weights)) for n in lengths])
    ranks = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    ranks /= ranks.sum()
    folder.mkdir(parents=True)
    for f in range(megabytes):
        size = 0
        with open(folder / f"part-{f:04d}.jsonl", "w") as out:
            while size < 2**20:
                chosen = words[rng.choice(len(words), size=int(rng.integers(50, 400)), p=ranks)]
                sentences = np.array_split(chosen, max(1, len(chosen) // 12))
                text = " ".join(" ".join(s).capitalize() + "." for s in sentences)
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                size += len(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=16, help="megabytes of synthetic text")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nodes", default="1,2,4", help="worker node counts, ascending")
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]

    import ray
    from data_throughput import bare_encode_tokens  # the baseline both benchmarks use
    from ray.cluster_utils import Cluster

    from raytrain_lm.config import DataConfig
    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.data.sources import expand_source, read_documents
    from raytrain_lm.tokenization import BPETokenizer

    work = Path(tempfile.mkdtemp(prefix="raytrain-prepare-scaling-"))
    corpus, warmup = work / "corpus", work / "warmup"
    write_corpus(corpus, args.mb)
    write_corpus(warmup, 1, seed=1)
    texts = [
        d.text
        for item in expand_source(str(corpus))
        for d in read_documents(item)
        if d.text.strip()
    ]
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 2 * 2**20:
            break
    tokenizer_file = BPETokenizer.train(sample, 4096).save(work)
    print(
        f"corpus: {len(texts)} documents, {sum(len(t) for t in texts) / 2**20:.1f} MB in "
        f"{args.mb} files; machine: {os.cpu_count()} logical CPUs, {_physical_cores()} "
        "physical cores",
        flush=True,
    )

    def baseline() -> tuple[int, float]:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: one CPU's worth
        started = time.perf_counter()
        n = bare_encode_tokens(tokenizer_file, texts)
        return n, time.perf_counter() - started

    def ours(source: Path, cache: Path) -> tuple[int, float]:
        cfg = DataConfig(
            sources=[str(source)],
            cache_dir=str(cache),
            max_source_bytes=None,
            tokenizer={"kind": "bpe", "path": str(tokenizer_file)},
        )
        started = time.perf_counter()
        prepared = prepare(cfg, progress=False)
        elapsed = time.perf_counter() - started
        shutil.rmtree(cache)
        splits = prepared.manifest.splits
        return splits["train"].tokens + splits["val"].tokens, elapsed

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    results: dict[int, list[float]] = {}
    base: list[float] = []
    tokens = None
    try:
        for n in counts:
            while len(cluster.list_all_nodes()) - 1 < n:
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            ours(warmup, work / "warm")
            for r in range(args.rounds):
                if n == counts[0]:  # the baseline alternates with the first node count
                    count, elapsed = baseline()
                    base.append(count / elapsed)
                    tokens = count
                count, elapsed = ours(corpus, work / f"data-{n}-{r}")
                assert tokens is None or count == tokens, (count, tokens)
                results.setdefault(n, []).append(count / elapsed)
                print(
                    f"nodes={n} round={r}: {count / elapsed:,.0f} tok/s ({elapsed:.1f} s)",
                    flush=True,
                )
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    one = statistics.median(results[counts[0]]) / counts[0]
    base_median = statistics.median(base)
    print(f"\nbaseline encode_batch, one thread: {base_median:,.0f} tok/s (rounds {base})")
    print(
        "| tokenizing nodes (1 CPU each) | prepare tok/s (median) | rounds | efficiency vs linear |"
    )
    print("| ---: | ---: | --- | ---: |")
    summary = {"tokens": tokens, "baseline_tok_s": base_median, "nodes": {}}
    for n in counts:
        median = statistics.median(results[n])
        efficiency = median / (n * one)
        rounds = ", ".join(f"{v:,.0f}" for v in results[n])
        print(f"| {n} | {median:,.0f} | {rounds} | {efficiency:.2f} |")
        summary["nodes"][n] = {"tok_s": median, "rounds": results[n], "efficiency": efficiency}
    ratio = statistics.median(results[counts[0]]) / base_median
    print(f"\nprepare on {counts[0]} node(s) / bare encode_batch (one thread): {ratio:.2f}")
    summary["ratio_to_encode_batch"] = ratio
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
