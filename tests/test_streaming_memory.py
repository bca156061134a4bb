"""Streaming a corpus several times larger than Ray's object store keeps a worker's memory
bounded and still delivers every sequence of the epoch exactly once, in order."""

import json
import subprocess
import sys
from pathlib import Path

from support.stream_memory_check import OBJECT_STORE, write_corpus

from raytrain_lm.config import DataConfig
from raytrain_lm.data.prepare import prepare

HERE = Path(__file__).parent


def test_streaming_a_corpus_larger_than_the_object_store(tmp_path):
    write_corpus(tmp_path / "corpus.jsonl", docs=100_000)  # ~100M byte tokens, ~200 MB as uint16
    prepared = prepare(
        DataConfig(
            sources=[str(tmp_path / "corpus.jsonl")],
            cache_dir=str(tmp_path / "data"),
            max_source_bytes=None,
            val_fraction=0.01,
            shard_tokens=8_000_000,
        ),
        progress=False,
    )
    # A separate process: its own Ray with an 80 MiB object store.
    out = subprocess.run(
        [sys.executable, str(HERE / "support" / "stream_memory_check.py"), prepared.directory],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(
        next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )
    assert result["corpus_bytes"] > 2 * OBJECT_STORE
    assert result["bytes_streamed"] > 2 * OBJECT_STORE
    assert result["positions_exact"]
    # the consumer's private memory does not grow with the data streamed through it: four
    # times the data costs no more than a quarter did, give or take allocator noise
    assert result["private_memory_growth"] < result["quarter_private_memory_growth"] + 32 * 2**20, (
        result
    )
    assert result["private_memory_growth"] < 128 * 2**20, result
