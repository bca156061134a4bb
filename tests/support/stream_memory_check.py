"""Run by test_streaming_memory.py in its own process: a Ray with a deliberately small object
store streams a prepared corpus several times larger than that store through the same
worker-side Ray Data pipeline training uses, and reports peak memory and what it consumed."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import ray

OBJECT_STORE = 80 * 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


@ray.remote(num_cpus=1)
def consume(data_dir: str, seq_len: int, micro_batch: int, steps: int) -> dict:
    from raytrain_lm.data.manifest import Manifest
    from raytrain_lm.data.order import SequenceOrder
    from raytrain_lm.data.stream import WorkerSlice, stream_train_batches

    manifest = Manifest.load(data_dir)
    order = SequenceOrder([s.tokens for s in manifest.splits["train"].shards], seq_len, seed=0)
    # Private memory only: objects read from Ray's shared-memory store are mapped into the
    # process and count in RSS without being a copy this process owns.
    base = _status_kib("RssAnon")
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status_kib("RssAnon"))
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    part = WorkerSlice(0, 1, micro_batch)
    seen, tokens = [], 0
    for positions, batch in stream_train_batches(
        data_dir, manifest, order, part, micro_batch, 0, steps, read_cpus=1
    ):
        seen.append(positions.copy())  # a view would pin the whole block in the object store
        tokens += batch.size
    done.set()
    seen = np.concatenate(seen)
    return {
        "private_memory_growth": (peak[0] - base) * 1024,
        "shared_peak": _status_kib("VmHWM") * 1024,
        "tokens_streamed": tokens,
        "bytes_streamed": tokens * np.dtype(manifest.dtype).itemsize,
        "positions_exact": bool(np.array_equal(seen, np.arange(steps * micro_batch))),
        "epoch_size": order.epoch_size(0),
    }


def write_corpus(path: Path, docs: int, doc_bytes: int = 1000) -> None:
    """Random lowercase text as JSON Lines: incompressible enough to make big shards."""
    rng = np.random.default_rng(0)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      \n.,", dtype=np.uint8)
    with open(path, "w") as f:
        for _ in range(docs // 1000):
            chunk = alphabet[rng.integers(0, len(alphabet), size=(1000, doc_bytes))]
            for row in chunk:
                f.write(json.dumps({"text": row.tobytes().decode()}) + "\n")


def main(data_dir: str) -> None:
    from raytrain_lm.data.manifest import Manifest

    ray.init(  # address="local": a Ray of its own, whatever else runs on this machine
        address="local",
        num_cpus=3,
        object_store_memory=OBJECT_STORE,
        include_dashboard=False,
        log_to_driver=False,
    )
    manifest = Manifest.load(data_dir)
    train_tokens = manifest.splits["train"].tokens
    seq_len, micro = 1023, 64
    steps = (train_tokens // (seq_len + 1) - len(manifest.splits["train"].shards)) // micro
    quarter = ray.get(consume.remote(data_dir, seq_len, micro, steps // 4))
    started = time.time()
    result = ray.get(consume.remote(data_dir, seq_len, micro, steps))
    result |= {
        "quarter_private_memory_growth": quarter["private_memory_growth"],
        "stream_s": round(time.time() - started, 1),
        "object_store_bytes": OBJECT_STORE,
        "corpus_bytes": train_tokens * np.dtype(manifest.dtype).itemsize,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
