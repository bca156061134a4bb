"""Data path speed, as ratios against plain baselines measured side by side.

1. prepare: `raytrain-lm prepare` (Ray Data: read files, BPE-tokenize in parallel, write
   shards with checksums, split, manifest) against raw HF `tokenizers` `Tokenizer.encode_batch`
   on the same documents already in memory, same tokenizer file, same cores. Goal >= 0.8.
   The corpus is `--mb` MB of real files on disk (the standard library's sources, copied as
   often as needed: the library alone is only about 10 MB). Ray is started before the rounds
   and not timed; everything `prepare` does after that is (listing and fingerprinting the
   inputs, loading the tokenizer, the Ray Data job, shard writing and hashing, the split, the
   manifest). The baseline's time covers loading the tokenizer file and encoding; reading the
   files is not in it. Both must count the same tokens. Rounds alternate which side runs first.
   CPU seconds (this process and all its descendants, i.e. the local Ray) are reported too:
   on a shared machine they are less noisy than wall time.
2. read: the training stream (Ray Data tasks reading shuffled sequences, what workers get)
   and `ray.data.read_parquet(...).iter_batches()` against reading the same shard files with
   pyarrow directly.
3. data wait: the share of step time a worker waits for data in the default run
   (`perf/data_wait_fraction`, per step in MLflow), for a shortened default run. Goal < 1%.

    .venv/bin/python benchmarks/data_throughput.py [--mb 20] [--rounds 2] [--steps 200]
    .venv/bin/python benchmarks/data_throughput.py --mb 60 --rounds 3 --steps 0   # prepare only
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
import pyarrow.parquet as pq


def bare_encode_tokens(tokenizer_file: Path, texts: list[str]) -> int:
    """The baseline both data benchmarks compare `prepare` with: HF `encode_batch` over
    documents in memory, 256 per call, counting tokens as prepare stores them (each document
    plus its end-of-text)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tokenizer_file))
    return sum(
        len(e.ids) + 1
        for i in range(0, len(texts), 256)
        for e in hf.encode_batch(texts[i : i + 256], add_special_tokens=False)
    )


def _tree_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and every live descendant (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    if not cpu:
        return None
    mine = {os.getpid()}
    grew = True
    while grew:
        before = len(mine)
        mine |= {pid for pid, parent in parents.items() if parent in mine}
        grew = len(mine) > before
    return sum(cpu[pid] for pid in mine)


def _corpus(directory: Path, megabytes: int) -> Path:
    """`megabytes` MB of real source files: the standard library, copied as often as needed."""
    from raytrain_lm.data.sources import expand_source

    files = expand_source("builtin:python-stdlib")
    root = Path(os.path.commonpath([f.uri for f in files]))
    total, copy = 0, 0
    while total < megabytes * 2**20:
        for item in files:
            target = directory / f"copy-{copy:02d}" / Path(item.uri).relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(item.uri, target)
            total += item.size
            if total >= megabytes * 2**20:
                break
        copy += 1
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=20, help="megabytes of source text to prepare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=200, help="steps of the default run for data wait (0: skip)"
    )
    parser.add_argument("--skip-read", action="store_true", help="measure prepare only")
    args = parser.parse_args()

    import ray

    import raytrain_lm
    from raytrain_lm.config import DataConfig, load_config
    from raytrain_lm.data.manifest import Manifest
    from raytrain_lm.data.order import SequenceOrder
    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.data.prepare_tokenizer import train_bpe
    from raytrain_lm.data.sources import expand_source, read_documents
    from raytrain_lm.data.stream import WorkerSlice, stream_train_batches

    work = Path(tempfile.mkdtemp(prefix="raytrain-data-bench-"))
    corpus = _corpus(work / "corpus", args.mb)
    # As `raytrain-lm prepare` sizes a local Ray (4 logical CPUs at least) on this machine.
    # address="local": a Ray of its own, even if another one runs on this machine
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    source = {"sources": [str(corpus)], "max_source_bytes": None}
    tokenizer = train_bpe(
        DataConfig(**source, tokenizer={"kind": "bpe", "vocab_size": 4096}), sample_bytes=4 * 2**20
    )
    tokenizer_file = tokenizer.save(work)
    # The documents prepare tokenizes: every non-blank one, in input order.
    texts = [
        d.text
        for item in expand_source(str(corpus))
        for d in read_documents(item)
        if d.text.strip()
    ]
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    print(f"corpus: {len(texts)} documents, {megabytes:.1f} MB", flush=True)

    def baseline() -> tuple[int, float, float | None]:
        cpu = _tree_cpu_seconds()
        started = time.perf_counter()
        n = bare_encode_tokens(tokenizer_file, texts)
        elapsed = time.perf_counter() - started
        return n, elapsed, None if cpu is None else _tree_cpu_seconds() - cpu

    def ours(r: int):
        cfg = DataConfig(
            **source,
            cache_dir=str(work / f"data-{r}"),
            tokenizer={"kind": "bpe", "path": str(tokenizer_file)},
        )
        cpu = _tree_cpu_seconds()
        started = time.perf_counter()
        prepared = prepare(cfg, progress=False)
        elapsed = time.perf_counter() - started
        splits = prepared.manifest.splits
        n = splits["train"].tokens + splits["val"].tokens
        return n, elapsed, None if cpu is None else _tree_cpu_seconds() - cpu, prepared

    prepare_ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            base_n, base_s, base_cpu = baseline()
            our_n, our_s, our_cpu, prepared = ours(r)
        else:
            our_n, our_s, our_cpu, prepared = ours(r)
            base_n, base_s, base_cpu = baseline()
        assert our_n == base_n, f"prepare stored {our_n} tokens, encode_batch made {base_n}"
        prepare_ratios.append((our_n / our_s, base_n / base_s))
        line = (
            f"prepare round {r}: ours {our_n / our_s:,.0f} tok/s ({our_s:.2f} s), "
            f"encode_batch {base_n / base_s:,.0f} tok/s ({base_s:.2f} s), "
            f"ratio {base_s / our_s:.3f}"
        )
        if our_cpu and base_cpu:
            cpu_ratios.append(base_cpu / our_cpu)
            line += f"; CPU s ours {our_cpu:.1f}, encode_batch {base_cpu:.1f}, ratio {base_cpu / our_cpu:.3f}"
        print(line, flush=True)
        shutil.rmtree(prepared.directory)

    def med(pairs):
        return {
            "ours": statistics.median(a for a, _ in pairs),
            "baseline": statistics.median(b for _, b in pairs),
            "ratio_median": statistics.median(a / b for a, b in pairs),
            "ratios": [round(a / b, 3) for a, b in pairs],
        }

    result = {"mb": round(megabytes, 1), "prepare_vs_encode_batch": med(prepare_ratios)}
    if cpu_ratios:
        result["prepare_cpu_efficiency_vs_encode_batch"] = {
            "ratio_median": statistics.median(cpu_ratios),
            "ratios": [round(x, 3) for x in cpu_ratios],
        }
    if args.skip_read:
        print("data: " + json.dumps(result))
        return

    prepared = prepare(
        DataConfig(
            **source,
            cache_dir=str(work / "data-read"),
            tokenizer={"kind": "bpe", "path": str(tokenizer_file)},
        ),
        progress=False,
    )
    data_dir = prepared.directory
    manifest = Manifest.load(data_dir)
    files = [str(Path(data_dir) / s.file) for s in manifest.splits["train"].shards]
    read = {"stream": [], "read_parquet": []}
    for r in range(args.rounds):
        started = time.perf_counter()
        direct = sum(
            len(pq.read_table(f).column("tokens").combine_chunks().flatten()) for f in files
        )
        direct_tps = direct / (time.perf_counter() - started)

        started = time.perf_counter()
        got = sum(
            len(b["tokens"].combine_chunks().flatten())
            for b in ray.data.read_parquet(files).iter_batches(batch_format="pyarrow")
        )
        rd_tps = got / (time.perf_counter() - started)

        order = SequenceOrder([s.tokens for s in manifest.splits["train"].shards], 1023, seed=r)
        steps = order.epoch_size(0) // 16
        started = time.perf_counter()
        streamed = sum(
            b.size
            for _, b in stream_train_batches(
                data_dir, manifest, order, WorkerSlice(0, 1, 16), 16, 0, steps
            )
        )
        stream_tps = streamed / (time.perf_counter() - started)
        read["stream"].append((stream_tps, direct_tps))
        read["read_parquet"].append((rd_tps, direct_tps))
        print(
            f"read round {r}: pyarrow {direct_tps:,.0f} tok/s, ray.data.read_parquet {rd_tps:,.0f} "
            f"({rd_tps / direct_tps:.3f}), training stream {stream_tps:,.0f} ({stream_tps / direct_tps:.3f})",
            flush=True,
        )

    result["training_stream_vs_pyarrow"] = med(read["stream"])
    result["read_parquet_vs_pyarrow"] = med(read["read_parquet"])
    if not args.steps:
        print("data: " + json.dumps(result))
        return
    overrides = [
        f"name=data-wait-{int(time.time())}",
        f"output_dir={work / 'runs'}",
        f"data.cache_dir={work / 'demo-data'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"training.max_steps={args.steps}",
        "training.sample_tokens=0",
        "training.progress=false",
    ]
    summary = raytrain_lm.train(load_config(None, overrides), sample=False)
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_metric_history(
        summary["mlflow_run_id"], "perf/data_wait_fraction"
    )
    waits = np.array([m.value for m in sorted(history, key=lambda m: m.step)][3:])
    result["data_wait_fraction"] = {
        "mean": float(waits.mean()),
        "p99": float(np.percentile(waits, 99)),
        "steps": len(waits),
    }
    print("data: " + json.dumps(result))


if __name__ == "__main__":
    main()
