"""`raytrain-lm eval`: a run's loss and perplexity on any text.

The text takes the run's own data path: `prepare` tokenizes it with the run's tokenizer into
token shards (every token held out, none for training), then a group of Ray Train workers
scores it with the checkpoint's weights, each a strided share of the sequences, and the sums
are all-reduced. A sequence is `model.block_size + 1` tokens of one shard, the windows
overlapping by one token, so each token is scored at most once, with up to `block_size`
tokens of context; each shard's first token and its tail shorter than a window are not.
The figures are logged to the run's MLflow run at the checkpoint's step (`eval/<name>/loss`,
`eval/<name>/perplexity`), with a JSON record.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from raytrain_lm import storage
from raytrain_lm.checkpoints import read_state
from raytrain_lm.config import RunConfig, read_written_config
from raytrain_lm.data.checks import check_inputs
from raytrain_lm.data.manifest import verify_shards
from raytrain_lm.data.prepare import prepare
from raytrain_lm.errors import UserError
from raytrain_lm.generate import resolve_checkpoint
from raytrain_lm.placement import worker_resources
from raytrain_lm.rundir import CONFIG_FILE, TOKENIZER_FILE, TRACKING_FILE, RunDir
from raytrain_lm.runtime import ensure_ray, use_gpu
from raytrain_lm.tokenization import tokenizer_from_json
from raytrain_lm.trainer.storage_checks import check_nodes_see

DEFAULT_BATCH = 8


def evaluate(
    run: str | Path,
    sources: list[str],
    *,
    workers: int = 1,
    output_dir: str | Path = "runs",
    name: str | None = None,
    batch_size: int | None = None,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """Scores the newest complete checkpoint of `run` (a run name under `output_dir`, a run
    folder or a checkpoint folder) on the text `sources` name, on `workers` Ray Train workers.
    Returns loss (nats per token), perplexity, tokens scored and where they were logged."""
    if workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if not sources:
        raise UserError("no text to evaluate on: name at least one source with --data")
    name = name or _name_for(sources)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UserError(f"eval name {name!r}: use letters, digits, '_', '.' and '-' only")
    checkpoint = resolve_checkpoint(str(run), str(output_dir))
    if not storage.is_uri(checkpoint):  # workers run in folders of their own
        checkpoint = os.path.abspath(checkpoint)
    run_dir = RunDir(str(storage.Location(checkpoint).parent))
    trained = read_written_config(
        yaml.safe_load(storage.read_bytes(storage.join(checkpoint, CONFIG_FILE)))
    )
    tokenizer = tokenizer_from_json(
        storage.read_bytes(storage.join(checkpoint, TOKENIZER_FILE)).decode("utf-8")
    )
    cfg = _evaluation_config(trained, run_dir, sources, workers, max_bytes)
    check_inputs(cfg.data)  # a source that names nothing is refused before Ray starts
    ensure_ray(cfg.scaling)
    prepared = prepare(cfg.data, tokenizer=tokenizer, held_out_only=True)
    verify_shards(prepared.directory, prepared.manifest)
    shard_tokens = [s.tokens for s in prepared.manifest.splits["val"].shards]
    needed = trained.model.block_size + 1
    if max(shard_tokens, default=0) < needed:
        raise UserError(
            f"{', '.join(sources)}: {sum(shard_tokens)} tokens, fewer than one sequence of "
            f"{needed} (model.block_size + 1) to score"
        )
    state = read_state(checkpoint)
    print(
        f"[raytrain-lm] evaluating {checkpoint} (step {state.step}) on {prepared.directory}: "
        f"{sum(shard_tokens):,} tokens, {workers} worker(s)",
        flush=True,
    )
    batch = batch_size or trained.training.micro_batch_size or DEFAULT_BATCH
    check_nodes_see(cfg, prepared.directory)
    metrics = _run_workers(cfg, run_dir, checkpoint, prepared.directory, batch)
    seq_len = trained.model.block_size
    loss = metrics["loss_sum"] / metrics["sequences"]
    result = {
        "run": trained.name,
        "checkpoint": str(checkpoint),
        "step": state.step,
        "name": name,
        "sources": list(cfg.data.sources),
        "data": str(prepared.directory),
        "tokens": int(metrics["sequences"]) * seq_len,
        "loss": loss,
        "perplexity": math.exp(loss),
        "workers": workers,
        "mlflow_run_id": None,
    }
    result["mlflow_run_id"] = _log(run_dir, result)
    return result


def _name_for(sources: list[str]) -> str:
    """`wiki.test.txt` -> `wiki`, `builtin:python-docs` -> `python-docs`, `s3://b/held/*.jsonl`
    -> `held`: each source's last path part with a name in it, joined by `_`."""
    stems = []
    for source in sources:
        parts = re.split(r"[/:]", source)
        names = [re.sub(r"[^A-Za-z0-9_-]+", "", p.split(".")[0]) for p in parts]
        stems.append(next((n for n in reversed(names) if n), "text"))
    return "_".join(stems)[:64]


def _evaluation_config(
    trained: RunConfig, run_dir: RunDir, sources: list[str], workers: int, max_bytes: int | None
) -> RunConfig:
    """The run's config with the text to score and a fixed group of `workers`."""
    raw = trained.model_dump()
    raw["output_dir"] = str(run_dir.parent)  # where the run is now
    raw["data"] |= {"sources": list(sources), "prepared": None, "max_source_bytes": max_bytes}
    raw["data"]["tokenizer"]["path"] = None  # the checkpoint's own tokenizer is used
    raw["scaling"] |= {"num_workers": workers, "min_workers": None, "max_workers": None}
    raw["model"]["init_from"] = None
    # Only the group's size matters here; a batch that divides it keeps the config valid.
    raw["training"] |= {"global_batch_size": workers, "micro_batch_size": None}
    try:
        return RunConfig.model_validate(raw).resolved()
    except ValueError as exc:
        raise UserError(str(exc).splitlines()[-1].strip()) from None


def _run_workers(
    cfg: RunConfig, run_dir: RunDir, checkpoint: str, data_dir: str, batch: int
) -> dict[str, float]:
    import ray
    from ray.train import RunConfig as RayRunConfig
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2.api.config import LoggingConfig

    from raytrain_lm.trainer.eval_entry import EvalSpec, eval_loop_per_worker

    gpu = use_gpu(cfg.scaling)
    spec = EvalSpec(
        checkpoint=str(checkpoint),
        data_dir=str(data_dir),
        batch=batch,
        precision=cfg.training.precision,
    )
    trainer = TorchTrainer(
        lambda: eval_loop_per_worker(spec),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=gpu,
            **worker_resources(cfg.scaling, gpu, ray.cluster_resources()),
        ),
        # Nothing is checkpointed; Ray Train's own records of the evaluation go beside the
        # run's checkpoints, in storage every node of a multi-node run can reach.
        run_config=RayRunConfig(
            name=f"eval-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(run_dir.at("evaluations")),
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    return trainer.fit().return_value


def _log(run_dir: RunDir, result: dict[str, Any]) -> str | None:
    """Logs `result` to the run's MLflow run (None when the run was not tracked)."""
    from raytrain_lm.tracking.mlflow_tracker import MLflowTracker

    record = run_dir.read_text(TRACKING_FILE)
    if record is None:
        print(f"[raytrain-lm] {run_dir} was not tracked: results printed only", flush=True)
        return None
    tracking = json.loads(record)
    tracker = MLflowTracker(tracking["tracking_uri"], tracking["mlflow_run_id"])
    prefix = f"eval/{result['name']}"
    tracker.log_metrics(
        {
            f"{prefix}/loss": result["loss"],
            f"{prefix}/perplexity": result["perplexity"],
            f"{prefix}/tokens": result["tokens"],
        },
        step=result["step"],
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, f"{result['name']}-step{result['step']}.json")
        path.write_text(json.dumps(result | {"mlflow_run_id": tracker.run_id}, indent=2))
        tracker.log_artifact(path, "evaluations")
        tracker.finish(status=None)  # the run's status stays its own
    return tracker.run_id
