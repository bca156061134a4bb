"""datatrove's side of benchmarks/curate_vs_datatrove.py: its virtualenv, and its 4 MinHash
stages, which run in a subprocess of datatrove's interpreter with this file as the script
(`--datatrove-worker CORPUS WORK --files N --cpus M`). Apart from the script so that it stays
under 500 lines and so that what datatrove's virtualenv executes imports neither raytrain_lm
nor torch nor Ray: standard library (and curate_corpus, likewise) at module level, datatrove
inside the worker."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from curate_corpus import BANDS, NGRAM, ROWS, CpuMeter  # noqa: E402

DEFAULT_VENV = HERE / "results" / "datatrove-venv"
DATATROVE_PACKAGES = ["datatrove==0.10.1", "xxhash<4", "regex", "spacy", "orjson", "tokenizers"]


def ensure_datatrove(python: Path) -> None:
    """Creates the virtualenv of `python` (its bin/ parent) with datatrove, unless there."""
    if python.exists():
        return
    venv = python.parent.parent
    print(f"creating {venv} with {' '.join(DATATROVE_PACKAGES)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *DATATROVE_PACKAGES], check=True)


def datatrove_worker(corpus: str, work: str, tasks: int, workers: int) -> None:
    """Runs in datatrove's virtualenv: the 4 MinHash stages; prints one JSON line with the
    removed ids, every clustered document's cluster, and the stages' times."""
    import logging

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from loguru import logger

    logger.remove()  # its per-task logs and stats go to logging_dir; keep the console quiet
    logging.disable(logging.WARNING)
    config = MinhashConfig(n_grams=NGRAM, num_buckets=BANDS, hashes_per_bucket=ROWS)
    w = Path(work)

    def reader():
        return JsonlReader(corpus, glob_pattern="*.jsonl", text_key="text", id_key="id")

    stages = [
        LocalPipelineExecutor(
            pipeline=[
                reader(),
                MinhashDedupSignature(output_folder=str(w / "sigs"), config=config),
            ],
            tasks=tasks,
            workers=workers,
            logging_dir=str(w / "logs" / "1"),
        ),
        LocalPipelineExecutor(
            pipeline=[
                MinhashDedupBuckets(
                    input_folder=str(w / "sigs"), output_folder=str(w / "buckets"), config=config
                )
            ],
            tasks=BANDS,
            workers=workers,
            logging_dir=str(w / "logs" / "2"),
        ),
        LocalPipelineExecutor(
            pipeline=[
                MinhashDedupCluster(
                    input_folder=str(w / "buckets"),
                    output_folder=str(w / "remove"),
                    config=config,
                    save_cluster_id=True,
                )
            ],
            tasks=1,
            logging_dir=str(w / "logs" / "3"),
        ),
        LocalPipelineExecutor(
            pipeline=[
                reader(),
                MinhashDedupFilter(
                    input_folder=str(w / "remove"),
                    exclusion_writer=JsonlWriter(str(w / "removed"), compression=None),
                    load_cluster_ids=True,
                ),
                JsonlWriter(str(w / "kept"), compression=None),
            ],
            tasks=tasks,
            workers=workers,
            logging_dir=str(w / "logs" / "4"),
        ),
    ]
    times = []
    for stage in stages:
        started = time.perf_counter()
        stage.run()
        times.append(time.perf_counter() - started)
    removed: list[int] = []
    clusters: dict[int, list[int]] = {}
    for kind in ("removed", "kept"):
        for path in sorted((w / kind).glob("*.jsonl")):
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    gid = int(row["id"])
                    if kind == "removed":
                        removed.append(gid)
                    cluster = row["metadata"].get("minhash_cluster_id", -1)
                    if cluster >= 0:
                        clusters.setdefault(cluster, []).append(gid)
    result = {"removed": removed, "clusters": list(clusters.values()), "stage_seconds": times}
    print("DATATROVE " + json.dumps(result))


def run_datatrove(python: Path, corpus: Path, work: Path, tasks: int, workers: int) -> dict:
    """datatrove's pipeline in a subprocess: its result, wall and CPU seconds."""
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    command = [
        str(python),
        str(Path(__file__).resolve()),
        "--datatrove-worker",
        str(corpus),
        str(work),
    ]
    with CpuMeter() as cpu:
        done = subprocess.run(
            [*command, "--files", str(tasks), "--cpus", str(workers)],
            capture_output=True,
            text=True,
        )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"datatrove failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("DATATROVE "))
    result = json.loads(line.removeprefix("DATATROVE "))
    result["wall"], result["cpu"] = wall, cpu.seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--datatrove-worker", nargs=2, required=True, metavar=("CORPUS", "WORK"))
    parser.add_argument("--files", type=int, required=True, help="tasks of stages 1 and 4")
    parser.add_argument("--cpus", type=int, required=True, help="workers")
    args = parser.parse_args()
    datatrove_worker(*args.datatrove_worker, tasks=args.files, workers=args.cpus)


if __name__ == "__main__":
    main()
