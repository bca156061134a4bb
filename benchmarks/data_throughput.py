"""Data path speed, as ratios against plain baselines measured side by side.

1. prepare: `raytrain-lm prepare` (Ray Data: read, BPE-tokenize in parallel, write shards)
   against HF `tokenizers` `encode_batch` on the same documents already in memory, same cores.
   Goal >= 0.8.
2. read: the training stream (Ray Data tasks reading shuffled sequences, what workers get)
   and `ray.data.read_parquet(...).iter_batches()` against reading the same shard files with
   pyarrow directly.
3. data wait: the share of step time a worker waits for data in the default run
   (`perf/data_wait_fraction`, per step in MLflow), for a shortened default run. Goal < 1%.

    .venv/bin/python benchmarks/data_throughput.py [--mb 20] [--rounds 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=20, help="megabytes of stdlib source to tokenize")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=200, help="steps of the default run for data wait"
    )
    args = parser.parse_args()

    import ray

    import raytrain_lm
    from raytrain_lm.config import DataConfig, load_config
    from raytrain_lm.data.manifest import Manifest
    from raytrain_lm.data.order import SequenceOrder
    from raytrain_lm.data.prepare import prepare, train_bpe
    from raytrain_lm.data.sources import expand_source, read_documents
    from raytrain_lm.data.stream import WorkerSlice, stream_train_batches

    work = Path(tempfile.mkdtemp(prefix="raytrain-data-bench-"))
    ray.init(num_cpus=4, log_to_driver=False)
    source = {"sources": ["builtin:python-stdlib"], "max_source_bytes": args.mb * 2**20}
    tokenizer = train_bpe(
        DataConfig(**source, tokenizer={"kind": "bpe", "vocab_size": 4096}), sample_bytes=4 * 2**20
    )
    tokenizer.save(work)
    texts = []
    for item in expand_source("builtin:python-stdlib"):
        texts += [d.text for d in read_documents(item) if d.text.strip()]
        if sum(len(t.encode()) for t in texts) > args.mb * 2**20:
            break

    prepare_ratios = []
    for r in range(args.rounds):
        started = time.perf_counter()
        n = sum(
            len(ids) + 1
            for i in range(0, len(texts), 256)
            for ids in tokenizer.encode_batch(texts[i : i + 256])
        )
        baseline = n / (time.perf_counter() - started)
        cfg = DataConfig(
            **source,
            cache_dir=str(work / f"data-{r}"),
            tokenizer={"kind": "bpe", "path": str(work / "tokenizer.json")},
        )
        started = time.perf_counter()
        prepared = prepare(cfg, progress=False)
        ours = (
            prepared.manifest.splits["train"].tokens + prepared.manifest.splits["val"].tokens
        ) / (time.perf_counter() - started)
        prepare_ratios.append((ours, baseline))
        print(
            f"prepare round {r}: ours {ours:,.0f} tok/s, encode_batch {baseline:,.0f} tok/s ({ours / baseline:.3f})",
            flush=True,
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

    def med(pairs):
        return {
            "ours": statistics.median(a for a, _ in pairs),
            "baseline": statistics.median(b for _, b in pairs),
            "ratio_median": statistics.median(a / b for a, b in pairs),
        }

    result = {
        "prepare_vs_encode_batch": med(prepare_ratios),
        "training_stream_vs_pyarrow": med(read["stream"]),
        "read_parquet_vs_pyarrow": med(read["read_parquet"]),
        "data_wait_fraction": {
            "mean": float(waits.mean()),
            "p99": float(np.percentile(waits, 99)),
            "steps": len(waits),
        },
    }
    print("data: " + json.dumps(result))


if __name__ == "__main__":
    main()
