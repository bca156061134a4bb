"""Near-duplicate removal, side by side with HF datatrove's MinHash pipeline (issue 34.5), and
`prepare` with curation on vs off.

Corpus (generated, seeded, no downloads): `--originals` prose-like documents of 200-500 words
(sentences of 6-20 words, commas, paragraphs) drawn from a Zipf-distributed vocabulary of
50,000 pseudo-words, so that unrelated documents share no 5-gram to speak of. `--clusters` of
them get 1-3 planted copies each: exact copies, and near-duplicates in which a known fraction
of the words (1, 2, 3, 5, 10 or 20 %) is replaced by random words, spread over the text. The
documents are shuffled with each cluster's original placed first among its members, given an
`id`, and written as JSON Lines in `--files` files. Each copy's true Jaccard similarity to its
original over word 5-grams is computed exactly, for the ground truth.

1. Which documents go. datatrove: its 4 stages (MinhashDedupSignature, MinhashDedupBuckets,
   MinhashDedupCluster, MinhashDedupFilter) with MinhashConfig(n_grams=5, num_buckets=14,
   hashes_per_bucket=8), each stage a LocalPipelineExecutor (stages 1 and 4: one task per
   file; stage 2: 14 tasks; stage 3: one), `--cpus` workers, the JSON Lines written by stage 4
   (kept documents, and the removed ones through its exclusion writer). Ours: `prepare`'s
   deduplication pass as `prepare` runs it (`map_input_groups(inputs, duplicate_keys)`: Ray
   Data reading tasks emitting keys, then `find_duplicates`; data.curate.near_dedup on, scope
   global), on a local Ray of `--cpus` CPUs; its file of removed ids. Both keep one document
   per cluster, not by the same rule: we keep the first in input order, datatrove the root of
   its union-find (union by size; of a pair, the lower (file, document) becomes the root). So
   the removed sets are compared twice: as they are, and with datatrove's clusters (its
   cluster ids) each keeping its first document as ours do (the two clusterings compared); the
   script counts the clusters whose first document datatrove removed. Overlap = |A and B| /
   |A or B|, goal >= 0.95; also over the documents whose fate is no coin toss (not a copy, or
   a copy that the S-curve 1-(1-J^8)^14 catches with probability >= 0.99 or <= 0.01), and
   the overlap that two independent MinHash draws would give on these copies. Ground truth: a
   planted copy with Jaccard >= 0.75 to its original (FineWeb's target similarity) should go;
   an original, a unique document or a copy with Jaccard < 0.5 should stay; copies in between
   are reported per level but count in neither precision nor recall.
2. Speed: documents per second per core = documents / (wall seconds x `--cpus`). datatrove:
   the subprocess from start to end (interpreter, imports, the executors' worker processes,
   the 4 stages, and stage 4's writing the kept corpus); the time of stages 1-3 alone (what
   decides, like ours) is printed too. Ours: the deduplication pass, Ray already started and a
   small pass run beforehand (worker processes up), not timed. Rounds alternate which runs
   first. Ours is also timed in two halves: the keys (reading tasks: read, shingle, MinHash,
   band hashes; the dataset materialised to stop the clock, where prepare streams it on) and
   the grouping and clustering (`find_duplicates`), against datatrove's stage 1 and stages
   2-3. CPU seconds (user + system of the process tree, with what exited workers used) are
   printed beside: on a shared machine they are less noisy than wall time.
3. `prepare` (byte tokenizer, or `--tokenizer bpe`: BPE trained on the corpus as prepare does; the
   whole call, same Ray; `--prepare-only` skips 1 and 2) with data.curate.near_dedup on vs off:
   tokens/s, where on writes fewer tokens (duplicates gone), and the ratio of input
   documents per second (on / off), i.e. off's time / on's time.

datatrove runs in a virtualenv of its own (benchmarks/results/ is git-ignored), so that
neither it nor spaCy and their dependencies enter the project's environment. The script
creates it when `--datatrove-python` does not exist (the corpus and the CPU meter are in
curate_corpus.py, datatrove's side in datatrove_side.py, the script that its interpreter runs);
by hand:

    python3 -m venv benchmarks/results/datatrove-venv
    benchmarks/results/datatrove-venv/bin/pip install datatrove==0.10.1 'xxhash<4' regex \
        spacy orjson tokenizers

xxhash and spaCy are what its MinHash stages use (xxhash hashes the shingles, spaCy's blank
English tokenizer splits the words), regex its text normalisation, tokenizers an import of
`datatrove.pipeline.dedup`. Then (about 3 minutes on 2 quiet cores, 12,634 documents):

    .venv/bin/python benchmarks/curate_vs_datatrove.py [--originals 10000] [--clusters 1300] \
        [--files 8] [--cpus 2] [--rounds 2] [--datatrove-python PATH] [--skip-prepare]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from curate_corpus import BANDS, EDIT_LEVELS, ROWS, CpuMeter, write_corpus  # noqa: E402
from datatrove_side import (  # noqa: E402
    DEFAULT_VENV,
    datatrove_worker,
    ensure_datatrove,
    run_datatrove,
)

SHOULD_GO, SHOULD_STAY = 0.75, 0.5  # Jaccard to the original


# ------------------------------------------------------------------------------ our side


def run_ours(corpus: Path, work: Path) -> dict:
    """`prepare`'s deduplication pass (what `_run` does first with dedup on): ids removed
    (as global ids of the corpus), wall and CPU seconds."""
    import numpy as np

    from raytrain_lm.config import DataConfig
    from raytrain_lm.data.curate.dedup import REMOVED_FILE, find_duplicates
    from raytrain_lm.data.prepare_job import map_input_groups
    from raytrain_lm.data.prepare_tasks import duplicate_keys
    from raytrain_lm.data.sources import expand_sources

    cfg = DataConfig(
        sources=[str(corpus)],
        cache_dir=str(work / "cache"),
        max_source_bytes=None,
        curate={"near_dedup": {"enabled": True, "scope": "global"}},
    )
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with CpuMeter() as cpu:
        started = time.perf_counter()
        inputs = expand_sources(cfg.sources)
        keys = map_input_groups(
            inputs, duplicate_keys, text_field=cfg.text_field, curate=cfg.curate
        )
        # Materialised here only to time the two halves apart (prepare streams them): the
        # grouping cannot start its reduce before every key is in anyway.
        keys = keys.materialize()
        keyed = time.perf_counter()
        counts = find_duplicates(keys, cfg.curate, str(work))
        wall = time.perf_counter() - started
    table = np.load(work / REMOVED_FILE)
    # id = input index << 32 | ordinal in the input -> the corpus's global id
    names = [Path(i.uri).name for i in inputs]
    assert names == sorted(names), names
    return {
        "ids": table[:, 0],
        "counts": counts,
        "wall": wall,
        "keys_seconds": keyed - started,
        "cpu": cpu.seconds,
    }


def global_ids(ours, file_docs: list[int]) -> set[int]:
    import numpy as np

    offsets = np.concatenate([[0], np.cumsum(file_docs)[:-1]])
    return set((offsets[ours >> 32] + (ours & 0xFFFFFFFF)).tolist())


def run_prepare(corpus: Path, cache: Path, curate: bool, tokenizer: str = "byte") -> dict:
    from raytrain_lm.config import DataConfig
    from raytrain_lm.data.prepare import prepare

    cfg = DataConfig(
        sources=[str(corpus)],
        cache_dir=str(cache),
        max_source_bytes=None,
        tokenizer={"kind": tokenizer},
        curate={"near_dedup": {"enabled": curate, "scope": "global"}},
    )
    with CpuMeter() as cpu:
        started = time.perf_counter()
        prepared = prepare(cfg, progress=False)
        wall = time.perf_counter() - started
    shutil.rmtree(cache, ignore_errors=True)
    splits = prepared.manifest.splits
    return {
        "tokens": splits["train"].tokens + splits["val"].tokens,
        "documents": prepared.manifest.documents,
        "curation": prepared.manifest.curation,
        "wall": wall,
        "cpu": cpu.seconds,
    }


# ------------------------------------------------------------------------------ comparing


def overlap(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def first_of_each(clusters: list[list[int]]) -> set[int]:
    """The removals of keeping each cluster's first document (our policy)."""
    return {d for members in clusters for d in sorted(members)[1:]}


def _rounds(runs: list[dict]) -> str:
    return ", ".join(f"{r['wall']:.1f}" for r in runs)


def s_curve(s: float) -> float:
    return 1 - (1 - s**ROWS) ** BANDS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--originals", type=int, default=10_000, help="distinct documents")
    parser.add_argument("--clusters", type=int, default=1_300, help="originals given copies")
    parser.add_argument("--files", type=int, default=8, help="JSON Lines files")
    parser.add_argument("--cpus", type=int, default=2, help="datatrove workers = Ray CPUs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--datatrove-python", type=Path, default=DEFAULT_VENV / "bin" / "python")
    parser.add_argument("--skip-prepare", action="store_true", help="no curation on/off part")
    parser.add_argument(
        "--prepare-only", action="store_true", help="only the on/off part (no datatrove)"
    )
    parser.add_argument(
        "--tokenizer", choices=("byte", "bpe"), default="byte", help="prepare's tokenizer"
    )
    parser.add_argument("--datatrove-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.datatrove_worker:
        datatrove_worker(*args.datatrove_worker, tasks=args.files, workers=args.cpus)
        return

    version = ["-", "-", "-"]
    if not args.prepare_only:
        ensure_datatrove(args.datatrove_python)
        version = subprocess.run(
            [
                str(args.datatrove_python),
                "-c",
                "from importlib.metadata import version as v; "
                "print(v('datatrove'), v('spacy'), v('xxhash'))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    from importlib.metadata import version as installed

    work = Path(tempfile.mkdtemp(prefix="raytrain-curate-bench-"))
    corpus = work / "corpus"
    started = time.perf_counter()
    truth = write_corpus(corpus, args.originals, args.clusters, args.files)
    n_docs = len(truth["cluster"])
    megabytes = sum(p.stat().st_size for p in corpus.iterdir()) / 2**20
    warm = work / "warm-corpus"
    write_corpus(warm, 300, 40, 2, seed=1)
    print(
        f"corpus: {n_docs} documents ({args.originals} distinct, {n_docs - args.originals} "
        f"planted copies in {args.clusters} clusters), {megabytes:.1f} MB in {args.files} "
        f"files, written in {time.perf_counter() - started:.0f} s; machine: {os.cpu_count()} "
        f"logical CPUs; --cpus {args.cpus}; datatrove {version[0]} (spaCy {version[1]}, "
        f"xxhash {version[2]}), rensa {installed('rensa')}, ray {installed('ray')}",
        flush=True,
    )

    import ray

    from raytrain_lm.runtime import init_local_ray

    init_local_ray(num_cpus=args.cpus, log_to_driver=False)
    results: dict[str, list[dict]] = {
        "datatrove": [],
        "ours": [],
        "prepare_off": [],
        "prepare_on": [],
    }
    try:
        run_ours(warm, work / "ours-warm")  # worker processes up; not timed
        for r in range(0 if args.prepare_only else args.rounds):
            sides = ["datatrove", "ours"] if r % 2 == 0 else ["ours", "datatrove"]
            for side in sides:
                if side == "datatrove":
                    out = run_datatrove(
                        args.datatrove_python, corpus, work / "dt", args.files, args.cpus
                    )
                else:
                    out = run_ours(corpus, work / "ours")
                results[side].append(out)
                print(
                    f"round {r} {side}: {out['wall']:.1f} s wall, {out['cpu']:.1f} CPU s",
                    flush=True,
                )
        if not args.skip_prepare:
            run_prepare(warm, work / "prepare-warm", True, args.tokenizer)
            for r in range(args.rounds):
                for curate in [False, True] if r % 2 == 0 else [True, False]:
                    out = run_prepare(corpus, work / "prepare", curate, args.tokenizer)
                    results["prepare_on" if curate else "prepare_off"].append(out)
                    print(
                        f"round {r} prepare curate={'on' if curate else 'off'}: "
                        f"{out['tokens'] / out['wall']:,.0f} tok/s ({out['wall']:.1f} s)",
                        flush=True,
                    )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    summary = {"documents": n_docs, "megabytes": megabytes, "cpus": args.cpus}
    if not args.prepare_only:
        summary["removals"] = compare_removals(results, truth)
        summary["speed"] = report_speed(results, n_docs, args.cpus)
    if not args.skip_prepare:
        summary["prepare"] = report_prepare(results, n_docs, args.tokenizer)
        if not args.prepare_only:
            removed = len(global_ids(results["ours"][-1]["ids"], truth["file_docs"]))
            assert summary["prepare"]["on_documents"] == n_docs - removed, "prepare removed others"
    print("RESULT " + json.dumps(summary))


def compare_removals(results: dict, truth: dict) -> dict:
    """Which documents each side removed: counts, overlaps, per edit level, against truth."""
    import numpy as np

    dt, us = results["datatrove"][-1], results["ours"][-1]
    for other in results["datatrove"]:
        assert sorted(other["removed"]) == sorted(dt["removed"]), "datatrove not deterministic"
    ours = global_ids(us["ids"], truth["file_docs"])
    for other in results["ours"]:
        assert global_ids(other["ids"], truth["file_docs"]) == ours, "ours not deterministic"
    theirs_raw = set(dt["removed"])
    theirs = first_of_each(dt["clusters"])
    assert len(theirs) == len(theirs_raw)
    level, jaccard = np.array(truth["level"]), np.array(truth["jaccard"])
    n_docs = len(level)
    go = set(np.flatnonzero((level >= 0) & (jaccard >= SHOULD_GO)).tolist())
    stay = set(np.flatnonzero((level < 0) | (jaccard < SHOULD_STAY)).tolist())
    unique = set(np.flatnonzero(level < 0).tolist())
    p_all = np.array([s_curve(x) for x in jaccard[level >= 0]])
    # documents whose fate is no coin toss: not copies, or copies the S-curve catches with
    # probability >= 0.99 or <= 0.01
    p_doc = np.where(level >= 0, [s_curve(x) for x in jaccard], 0.0)
    clear = set(np.flatnonzero((p_doc <= 0.01) | (p_doc >= 0.99)).tolist())
    summary: dict = {
        "planted_copies": int((level >= 0).sum()),
        "removed": {"datatrove": len(theirs_raw), "ours": len(ours), "both": len(ours & theirs)},
        "overlap_raw": overlap(ours, theirs_raw),
        "overlap_same_policy": overlap(ours, theirs),
        "overlap_clear_cut": overlap(ours & clear, theirs_raw & clear),
        "clear_cut_documents": len(clear),
        # two independent MinHash draws of the same S-curve on the planted copies
        "overlap_expected": float((p_all * p_all).sum() / (1 - (1 - p_all) ** 2).sum()),
        "datatrove_clusters": len(dt["clusters"]),
        "datatrove_removed_first": sum(min(c) in theirs_raw for c in dt["clusters"]),
        "levels": {},
    }
    print(
        f"\nremoved: datatrove {len(theirs_raw)}, ours {len(ours)}, both "
        f"{len(ours & theirs_raw)}, of {n_docs} documents ({summary['planted_copies']} planted "
        f"copies)\noverlap |A and B| / |A or B|: as removed {summary['overlap_raw']:.3f}; with "
        f"datatrove's {len(dt['clusters'])} clusters each keeping its first document as ours "
        f"do: {summary['overlap_same_policy']:.3f} (datatrove removed the first document of "
        f"{summary['datatrove_removed_first']} clusters); expected of two independent MinHash "
        f"draws of the same S-curve: {summary['overlap_expected']:.3f}\noverlap over the "
        f"{len(clear)} documents whose fate is no coin toss (not a copy, or a copy caught with "
        f"probability >= 0.99 or <= 0.01): {summary['overlap_clear_cut']:.3f}"
    )
    print(
        "\n| words replaced | copies | Jaccard to original, mean (min-max) | S-curve "
        "1-(1-J^8)^14 | ours removed | datatrove removed | both | same decision | "
        "same decision expected |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, edit in enumerate(EDIT_LEVELS):
        mine = np.flatnonzero(level == i)
        j = jaccard[mine]
        p = np.array([s_curve(x) for x in j])
        a = np.array([d in ours for d in mine])
        b = np.array([d in theirs for d in mine])
        row = {
            "copies": len(mine),
            "jaccard": float(j.mean()),
            "s_curve": float(p.mean()),
            "ours": float(a.mean()),
            "datatrove": float(b.mean()),
            "both": float((a & b).mean()),
            "agreement": float((a == b).mean()),
            "agreement_expected": float(np.mean(p**2 + (1 - p) ** 2)),
        }
        summary["levels"][f"{edit:.2f}"] = row
        print(
            f"| {edit:.0%}{' (exact)' if edit == 0 else ''} | {len(mine)} | {j.mean():.3f} "
            f"({j.min():.2f}-{j.max():.2f}) | {p.mean():.3f} | {a.mean():.3f} | "
            f"{b.mean():.3f} | {row['both']:.3f} | {row['agreement']:.3f} | "
            f"{row['agreement_expected']:.3f} |"
        )
    print(
        f"\nground truth: should go, copies with Jaccard >= {SHOULD_GO} ({len(go)}); should "
        f"stay, originals and unique documents and copies < {SHOULD_STAY} ({len(stay)})"
    )
    print("| removed by | precision | recall | originals or unique documents removed |")
    print("| --- | ---: | ---: | ---: |")
    for name, removed in (
        ("ours", ours),
        ("datatrove", theirs_raw),
        ("datatrove, first of each cluster kept", theirs),
    ):
        judged = removed & (go | stay)
        precision = len(removed & go) / max(1, len(judged))
        recall = len(removed & go) / max(1, len(go))
        summary[f"precision_recall {name}"] = [precision, recall, len(removed & unique)]
        print(f"| {name} | {precision:.4f} | {recall:.4f} | {len(removed & unique)} |")
    return summary


def report_speed(results: dict, n_docs: int, cpus: int) -> dict:
    def median(runs: list[dict], key) -> float:
        return statistics.median(key(r) for r in runs)

    dt, us = results["datatrove"], results["ours"]
    rows = [
        ("datatrove, whole (subprocess: 4 stages, start-up)", dt, lambda r: r["wall"], "cpu"),
        ("datatrove, stage 1 (signatures)", dt, lambda r: r["stage_seconds"][0], None),
        ("datatrove, stages 1-3 (what decides)", dt, lambda r: sum(r["stage_seconds"][:3]), None),
        ("ours, whole (prepare's dedup pass, Ray up)", us, lambda r: r["wall"], "cpu"),
        ("ours, keys (read, shingle, MinHash)", us, lambda r: r["keys_seconds"], None),
        ("ours, grouping and clustering", us, lambda r: r["wall"] - r["keys_seconds"], None),
    ]
    print(
        f"\n| pipeline ({cpus} CPUs) | wall s, median (rounds) | documents/s/core (wall x "
        f"{cpus}) | CPU s | documents per CPU s |"
    )
    print("| --- | --- | ---: | ---: | ---: |")
    summary: dict = {}
    for name, runs, key, cpu in rows:
        wall = median(runs, key)
        rounds = ", ".join(f"{key(r):.1f}" for r in runs)
        used = statistics.median(r[cpu] for r in runs) if cpu else None
        cells = f"{used:.1f} | {n_docs / used:,.0f}" if used else " | "
        print(f"| {name} | {wall:.1f} ({rounds}) | {n_docs / (wall * cpus):,.0f} | {cells} |")
        summary[name] = {"wall": wall, "docs_s_core": n_docs / (wall * cpus), "cpu": used}
    dt_wall, us_wall = median(dt, lambda r: r["wall"]), median(us, lambda r: r["wall"])
    dt_cpu, us_cpu = median(dt, lambda r: r["cpu"]), median(us, lambda r: r["cpu"])
    summary["ours_over_datatrove_wall"] = dt_wall / us_wall
    summary["ours_over_datatrove_cpu"] = dt_cpu / us_cpu
    print(
        f"ours / datatrove, documents/s/core: {dt_wall / us_wall:.2f} by wall time, "
        f"{dt_cpu / us_cpu:.2f} by CPU seconds"
    )
    return summary


def report_prepare(results: dict, n_docs: int, tokenizer: str) -> dict:
    off, on = results["prepare_off"], results["prepare_on"]
    summary: dict = {}
    print(
        f"\n| prepare ({tokenizer} tokenizer) | wall s, median (rounds) | CPU s | documents kept | "
        "tokens written | tokens/s | input documents/s |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in (("curation off", off), ("near_dedup on (global)", on)):
        wall = statistics.median(r["wall"] for r in runs)
        tok_s = statistics.median(r["tokens"] / r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(
            f"| {name} | {wall:.1f} ({_rounds(runs)}) | {cpu:.1f} | {runs[-1]['documents']:,} "
            f"| {runs[-1]['tokens']:,} | {tok_s:,.0f} | {n_docs / wall:,.0f} |"
        )
        key = "on" if runs is on else "off"
        summary.update(
            {
                f"{key}_wall": wall,
                f"{key}_tok_s": tok_s,
                f"{key}_cpu": cpu,
                f"{key}_tokens": runs[-1]["tokens"],
                f"{key}_documents": runs[-1]["documents"],
            }
        )
    summary["tok_s_ratio"] = summary["on_tok_s"] / summary["off_tok_s"]
    summary["input_rate_ratio"] = summary["off_wall"] / summary["on_wall"]
    print(
        f"on / off: tokens/s {summary['tok_s_ratio']:.2f}, input documents/s "
        f"{summary['input_rate_ratio']:.2f}, CPU s {summary['on_cpu'] / summary['off_cpu']:.2f}"
    )
    return summary


if __name__ == "__main__":
    main()
