"""The `model` section. The presets live beside the fields they fill, so a new shape is one
edit here, and the model builders (models.py, huggingface.py) need nothing else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from raytrain_lm.config.base import _Section

# Named shapes (`model.preset`). Keys set beside a preset win over its values. Parameter counts
# depend on the tokenizer's vocabulary; the names give them at the vocabularies they were made
# for (GPT-2's 50,257 for 125m, Llama 3's 128,256 for 1b, Llama 2's 32,000 for 7b).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
             "block_size": 64},
    "125m": {"arch": "llama", "n_layer": 12, "n_head": 12, "n_kv_head": 12, "n_embd": 768,
             "ffn_hidden": 2048, "block_size": 1024},
    "1b": {"arch": "llama", "n_layer": 16, "n_head": 32, "n_kv_head": 8, "n_embd": 2048,
           "ffn_hidden": 8192, "block_size": 2048, "rope_theta": 500_000.0},
    "7b": {"arch": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 32, "n_embd": 4096,
           "ffn_hidden": 11008, "block_size": 4096, "tie_embeddings": False},
}  # fmt: skip


class ModelConfig(_Section):
    """The architecture and its shape. `vocab_size` comes from the tokenizer unless set (it must
    then be large enough). `preset` fills the shape from MODEL_PRESETS."""

    arch: Literal["gpt2", "llama"] = Field(
        "gpt2", description="gpt2: LayerNorm, GELU, learned positions; llama: RMSNorm, SwiGLU, RoPE"
    )
    preset: Literal["tiny", "125m", "1b", "7b"] | None = Field(
        None, description="a named shape (MODEL_PRESETS); keys set beside it win"
    )
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_kv_head: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention); n_head if unset"
    )
    n_embd: int = Field(128, ge=8)
    ffn_hidden: int | None = Field(
        None, ge=1, description="MLP width; gpt2: 4 * n_embd, llama: 8/3 * n_embd if unset"
    )
    block_size: int = Field(128, ge=2, description="context length in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = False
    tie_embeddings: bool = Field(True, description="output projection shares the token embedding")
    rope_theta: float = Field(10_000.0, gt=0.0, description="llama: RoPE base")
    norm_eps: float = Field(1e-5, gt=0.0, description="llama: RMSNorm epsilon")
    vocab_size: int | None = Field(None, ge=2)
    init_from: str | None = Field(
        None,
        description="a transformers folder (LlamaForCausalLM, GPT2LMHeadModel) to start from: "
        "its shape, weights and tokenizer (docs/export.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        # an unknown name is left to the field's own check, which names it and the closest
        if isinstance(data, dict) and data.get("preset") in MODEL_PRESETS:
            return {**MODEL_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _shape_is_consistent(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.arch == "gpt2":
            unsupported = {
                "n_kv_head": self.n_kv_head not in (None, self.n_head),
                "tie_embeddings": not self.tie_embeddings,
                "ffn_hidden": self.ffn_hidden not in (None, 4 * self.n_embd),
                "norm_eps": self.norm_eps != 1e-5,
            }
            for key, used in unsupported.items():
                if used:
                    raise ValueError(f"model.{key} is a llama setting: set model.arch=llama")
        else:
            if self.n_head % (self.n_kv_head or self.n_head):
                raise ValueError(
                    f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head "
                    f"({self.n_kv_head})"
                )
            if (self.n_embd // self.n_head) % 2:
                raise ValueError(
                    f"llama's rotary embeddings need an even head size: model.n_embd "
                    f"({self.n_embd}) / model.n_head ({self.n_head}) is odd"
                )
            if self.dropout or self.bias:
                raise ValueError("llama has no dropout or biases: unset model.dropout, model.bias")
        return self
