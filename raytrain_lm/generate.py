"""Sampling text from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import torch
import yaml

from raytrain_lm.causal_lm import CausalLM
from raytrain_lm.checkpoints import (
    CONFIG_FILE,
    MARKER_FILE,
    MODEL_FILE,
    PART_PREFIX,
    STATE_FILE,
    is_complete,
    latest_complete_checkpoint,
    load_model_state,
    local_copy,
)
from raytrain_lm.checkpoints.sharded import consolidated_weights
from raytrain_lm.config import read_written_config
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model
from raytrain_lm.rundir import RunDir
from raytrain_lm.storage import filesystem, join
from raytrain_lm.tokenization import Tokenizer, load_tokenizer


def resolve_checkpoint(run_or_checkpoint: str, output_dir: str = "runs") -> str:
    """A checkpoint folder, a run folder (its newest checkpoint) or a run name under
    output_dir; local or in a bucket. A folder that is neither a run nor a checkpoint (an
    export, a data folder that happens to have the run's name) gives way to the run of that
    name under output_dir."""
    other_folder = None
    for candidate in (run_or_checkpoint, join(output_dir, run_or_checkpoint)):
        if not _is_folder(candidate):
            continue
        if is_complete(candidate):
            return candidate
        latest = latest_complete_checkpoint(candidate)
        if latest is not None:
            return latest
        if RunDir(candidate).is_run() or _is_checkpoint(candidate):
            raise UserError(f"{candidate} holds no complete checkpoint")
        other_folder = other_folder or candidate
    if other_folder is not None:
        raise UserError(
            f"{other_folder} is {_what_folder(other_folder)}, not a run or a checkpoint, and "
            f"{output_dir}/ holds no run named '{run_or_checkpoint}'"
        )
    raise UserError(f"no run or checkpoint named '{run_or_checkpoint}' (looked in {output_dir}/)")


def _is_checkpoint(location: str) -> bool:
    """A checkpoint folder, complete or not (its state or a marker was written)."""
    files = set(RunDir(location).list_files())
    return bool(files & {STATE_FILE, MARKER_FILE}) or any(
        name.startswith(PART_PREFIX) for name in files
    )


def _what_folder(location: str) -> str:
    files = set(RunDir(location).list_files())
    if "config.json" in files and any(name.endswith(".safetensors") for name in files):
        return "a Hugging Face transformers folder (an export)"
    return "a folder"


def _is_folder(location: str) -> bool:
    fs, inner = filesystem(location)
    try:
        return fs.get_file_info(inner).type == pafs.FileType.Directory
    except OSError:  # not a bucket one can reach: no such run there
        return False


def load_model(checkpoint: str | Path, device: str = "cpu") -> tuple[CausalLM, Tokenizer]:
    from safetensors.torch import load_file

    with local_copy(checkpoint) as folder:
        cfg = read_written_config(yaml.safe_load((folder / CONFIG_FILE).read_text()))
        tokenizer = load_tokenizer(folder)
        model = build_model(cfg.model, tokenizer.vocab_size)
        if (folder / MODEL_FILE).is_file():
            load_model_state(model, load_file(str(folder / MODEL_FILE), device=device))
        else:  # a sharded checkpoint from before the end of a run: gathered here
            model.load_state_dict(consolidated_weights(folder, model))
    return model.to(device).eval(), tokenizer


def sample(
    checkpoint: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """`prompt` (included) continued by `max_new_tokens` (at least 1) tokens, each drawn among
    the `top_k` likeliest (None: all) at `temperature` (0: always the likeliest)."""
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"temperature must be at least 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k must be at least 1 (None: no limit), got {top_k}")
    model, tokenizer = load_model(checkpoint)
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(
        torch.tensor([ids], dtype=torch.long), max_new_tokens, temperature, top_k, generator
    )
    return tokenizer.decode(out[0].tolist())
