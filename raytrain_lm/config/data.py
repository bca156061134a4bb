"""The `data` section and its tokenizer: all that `prepare` reads, so that a dataset can be
prepared (and its cache keyed) from this section alone.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from raytrain_lm.config.base import _Section, check_storage_location
from raytrain_lm.config.curate import CurateConfig


class TokenizerConfig(_Section):
    kind: Literal["byte", "char", "bpe"] = "byte"
    path: str | None = Field(None, description="tokenizer.json to load (bpe); trained if unset")
    vocab_size: int = Field(4096, ge=260, description="target vocabulary when training BPE")


class DataConfig(_Section):
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:python-stdlib"],
        description="text files, folders or globs; builtin:python-stdlib / builtin:python-docs",
    )
    prepared: str | None = Field(
        None, description="train on this folder written by `raytrain-lm prepare`; sources unused"
    )
    text_field: str = Field("text", description="JSON Lines field / Parquet column holding text")
    cache_dir: str = Field("data", description="where prepared datasets go (a path or a URI)")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    val_max_tokens: int | None = Field(
        20_000_000, ge=2, description="cap on validation tokens taken from the stream's tail"
    )
    max_source_bytes: int | None = Field(
        6_000_000, ge=1, description="cap on input bytes read (None: everything)"
    )
    shard_tokens: int = Field(1 << 22, ge=1024, description="tokens per Parquet shard")
    shuffle_window_shards: int = Field(8, ge=1, description="shards shuffled together per window")
    seed: int = 1337
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    curate: CurateConfig = Field(default_factory=CurateConfig)

    @field_validator("cache_dir", "prepared")
    @classmethod
    def _storage_location(cls, value: str | None) -> str | None:
        return check_storage_location(value)

    @field_validator("sources", mode="before")
    @classmethod
    def _one_source_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value
