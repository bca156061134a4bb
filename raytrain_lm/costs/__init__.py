"""Cost planning (`raytrain-lm plan`, `raytrain_lm.plan`): what a configured run will cost on
each accelerator type, worker count and capacity, from a price catalog and the model's
FLOPs, calibrated by a run that already ran. docs/cost.md."""

from __future__ import annotations

from pathlib import Path

from raytrain_lm.config import RunConfig
from raytrain_lm.config.durations import parse_duration_h
from raytrain_lm.errors import UserError

WORKER_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def plan(
    cfg: RunConfig,
    tokens: float | None = None,
    deadline: str | float | None = None,
    budget_usd: float | None = None,
    from_run: str | None = None,
    catalog_path: str | Path | None = None,
    worker_counts: tuple[int, ...] = WORKER_COUNTS,
) -> dict:
    """The ranked candidates (cheapest first) as plain data: `estimates`, `cheapest` (the
    cheapest that meets the deadline and budget, or None), `inputs` (what was measured, what
    assumed) and the catalog's date and source."""
    import torch

    from raytrain_lm.costs.calibration import measured_inputs
    from raytrain_lm.costs.catalog import DEFAULT_CATALOG, load_catalog
    from raytrain_lm.costs.planner import DEFAULT_MFU, Inputs, cheapest_in_time, plan_candidates
    from raytrain_lm.models import build_model
    from raytrain_lm.rundir import RunDir

    catalog = load_catalog(catalog_path)
    vocab = cfg.model.vocab_size or _tokenizer_vocab(cfg)
    with torch.device("meta"):  # shapes only: no memory, however large the model
        model = build_model(cfg.model, vocab)
    tokens_per_step = cfg.training.global_batch_size * cfg.model.block_size
    tokens = float(tokens or cfg.training.max_steps * tokens_per_step)
    calibration: dict = {"measured": []}
    if from_run is not None:
        run_dir = (
            RunDir.coerce(from_run) if "/" in from_run else RunDir.of(cfg.output_dir, from_run)
        )
        if not run_dir.is_run():
            raise UserError(f"--from {from_run}: no run at {run_dir}")
        calibration = measured_inputs(run_dir, catalog)
    inputs = Inputs(
        tokens=tokens,
        params=model.num_params(non_embedding=False),
        flops_per_token=model.flops_per_token(),
        tokens_per_step=tokens_per_step,
        **calibration,
    )
    try:
        deadline_h = parse_duration_h(deadline)
    except ValueError as exc:
        raise UserError(f"--deadline: {exc}; got {deadline!r}") from None
    # Only what a run of this config can train with: a recommendation it refuses misleads.
    runnable = [n for n in worker_counts if cfg.batch_splits_over(n)]
    estimates = plan_candidates(inputs, catalog, runnable, deadline_h, budget_usd)
    assumed = [f"MFU {DEFAULT_MFU:.0%} on types not measured", "catalog prices and interruptions"]
    return {
        "run": cfg.name,
        "tokens": tokens,
        "params": inputs.params,
        "flops_per_token": inputs.flops_per_token,
        "deadline_h": deadline_h,
        "budget_usd": budget_usd,
        "catalog": {
            "path": str(catalog_path or DEFAULT_CATALOG),
            "as_of": catalog.as_of,
            "source": catalog.source,
        },
        "inputs": {"measured": inputs.measured, "assumed": assumed},
        "global_batch_size": cfg.training.global_batch_size,
        "batch_does_not_split": [n for n in worker_counts if n not in runnable],
        "estimates": [e.as_dict() for e in estimates],
        "cheapest": (lambda e: e.as_dict() if e else None)(cheapest_in_time(estimates)),
    }


def _tokenizer_vocab(cfg: RunConfig) -> int:
    tokenizer = cfg.data.tokenizer
    return tokenizer.vocab_size if tokenizer.kind == "bpe" else 257
