"""Checks on a run's data settings that refuse it with one line before work starts:
`check_inputs` before any Ray starts (it lists inputs but reads no corpus, and checks that a
bucket it is to read from or write to exists and can be reached), and
`check_data_matches_model` once the prepared dataset's manifest is known."""

from __future__ import annotations

from raytrain_lm import storage
from raytrain_lm.config import DataConfig, ModelConfig
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.data.order import check_split_holds_a_sequence
from raytrain_lm.data.sources import InputFile, expand_sources
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import Tokenizer, load_tokenizer


def given_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """The BPE tokenizer `data.tokenizer.path` names (None when BPE is to be trained, or the
    kind needs none), refused when it is missing, not a tokenizer, or of another kind."""
    tok = cfg.tokenizer
    if tok.kind != "bpe" or not tok.path:
        return None
    tokenizer = load_tokenizer(tok.path)
    if tokenizer.kind != tok.kind:
        raise UserError(
            f"data.tokenizer.path {tok.path} holds a {tokenizer.kind} tokenizer; "
            f"data.tokenizer.kind is {tok.kind}"
        )
    return tokenizer


def check_inputs(cfg: DataConfig) -> list[InputFile]:
    """Refuses what can be refused without Ray and without reading the corpus: a
    `data.prepared` folder without a manifest, a `data.tokenizer.path` that is not a BPE
    tokenizer file, a source that names nothing, a `data.prepared` or `data.cache_dir` bucket
    that does not exist or cannot be reached. Returns the inputs the sources name (none for
    prepared data), which `prepare` goes on to read."""
    if cfg.prepared:
        storage.check_reachable(cfg.prepared, "data.prepared")
        Manifest.load(cfg.prepared)
        return []
    given_tokenizer(cfg)
    inputs = expand_sources(cfg.sources)
    storage.check_reachable(cfg.cache_dir, "data.cache_dir")
    return inputs


def check_data_matches_model(data: DataConfig, model: ModelConfig, manifest: Manifest) -> None:
    """Refuses a prepared dataset that the model cannot train on: another tokenizer kind than
    configured, a larger vocabulary than `model.vocab_size`, or a split without one sequence
    of `model.block_size + 1` tokens (validation too: it would report a loss of 0)."""
    if data.prepared and manifest.tokenizer_kind != data.tokenizer.kind:
        raise UserError(
            f"prepared data {data.prepared} uses a {manifest.tokenizer_kind} tokenizer, "
            f"the config says data.tokenizer.kind={data.tokenizer.kind}"
        )
    if model.vocab_size is not None and model.vocab_size < manifest.vocab_size:
        raise UserError(
            f"model.vocab_size ({model.vocab_size}) is smaller than the prepared data's "
            f"vocabulary ({manifest.vocab_size}, {manifest.tokenizer_kind} tokenizer)"
        )
    for split in ("train", "val"):
        shard_tokens = [s.tokens for s in manifest.splits[split].shards]
        check_split_holds_a_sequence(split, shard_tokens, model.block_size)
