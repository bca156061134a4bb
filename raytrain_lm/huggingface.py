"""Into and out of Hugging Face `transformers` model folders: what lm-eval-harness, vLLM, TGI
and the Hub read (`export`), and what a run may start from (`model.init_from`:
`apply_init_from` on the driver, `load_hf_weights` in the workers). Only safetensors, json and
`tokenizers` are used; `transformers` itself is not needed (the tests use it to check).

llama is `LlamaForCausalLM` (our module names are its names under `model.`); gpt2 is
`GPT2LMHeadModel`, whose Conv1D layers keep their weights transposed and which always has
biases (ours may have none: zeros are written, which compute the same).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from raytrain_lm.causal_lm import CausalLM
from raytrain_lm.checkpoints import load_model_state, model_state, tied_aliases
from raytrain_lm.config import ModelConfig, RunConfig, TokenizerConfig
from raytrain_lm.errors import UserError
from raytrain_lm.generate import load_model, resolve_checkpoint
from raytrain_lm.llama import Llama
from raytrain_lm.tokenization import EOT, BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer

MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default (`max_shard_size="5GB"`)
FORMATS = ("hf",)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def export(
    run_or_checkpoint: str,
    out: str | Path,
    output_dir: str = "runs",
    fmt: str = "hf",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Writes the newest complete checkpoint of a run (or the checkpoint folder given), from
    either strategy, into `out`, which must not exist or be empty. Returns `out`."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}'; supported: {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; choose another --out")
    model, tokenizer = load_model(resolve_checkpoint(run_or_checkpoint, output_dir))
    tokenizer_json = hf_tokenizer(tokenizer).to_str()  # refuses what it cannot export, first
    if isinstance(model, Llama):
        config, weights = _llama(model), _llama_weights(model)
    else:
        config, weights = _gpt2(model), _gpt2_weights(model)
    eot = tokenizer.eot_id
    config |= {"vocab_size": model.shape.vocab_size, "bos_token_id": eot, "eos_token_id": eot}
    config |= {"torch_dtype": "float32", "initializer_range": 0.02}
    out.mkdir(parents=True, exist_ok=True)
    try:
        _save_weights(weights, out, max_shard_bytes)
        _write_json(out / "config.json", config)
        _write_json(
            out / "generation_config.json",
            {"bos_token_id": eot, "eos_token_id": eot, "_from_model_config": True},
        )
        (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(
            out / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "model_max_length": model.block_size,
                "clean_up_tokenization_spaces": False,
            },
        )
        _write_json(out / "special_tokens_map.json", {"bos_token": EOT, "eos_token": EOT})
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written left behind
        raise
    return out


# ----------------------------------------------------------------------------- architectures


def _llama(model: Llama) -> dict[str, Any]:
    s = model.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.n_embd,
        "intermediate_size": s.ffn_hidden,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_kv_head,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.block_size,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": s.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }


def _llama_weights(model: Llama) -> dict[str, torch.Tensor]:
    # Ours are LlamaForCausalLM's names less its `model.` (the decoder) for all but the head.
    return {
        name if name.startswith("lm_head.") else f"model.{name}": tensor
        for name, tensor in model_state(model).items()
    }


def _gpt2(model: CausalLM) -> dict[str, Any]:
    s = model.shape
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_positions": s.block_size,
        "n_ctx": s.block_size,
        "n_embd": s.n_embd,
        "n_layer": s.n_layer,
        "n_head": s.n_head,
        "n_inner": 4 * s.n_embd,
        "activation_function": "gelu",  # exact GELU (nn.GELU), not GPT-2's tanh "gelu_new"
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }


def _gpt2_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    weights = {}
    for name, tensor in model_state(model).items():
        weights[name] = tensor.t().contiguous() if name.endswith(_CONV1D) else tensor
    # GPT2LMHeadModel always has biases: zeros where ours has none compute the same.
    for name, tensor in list(weights.items()):
        bias = name.removesuffix(".weight") + ".bias"
        in_blocks = name.startswith(("transformer.h.", "transformer.ln_f"))
        if in_blocks and bias not in weights:
            width = tensor.shape[-1] if name.endswith(_CONV1D) else tensor.shape[0]
            weights[bias] = torch.zeros(width, dtype=tensor.dtype)
    return weights


# ----------------------------------------------------------------------------- files


def _save_weights(weights: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """One `model.safetensors`, or numbered shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own) with the index `transformers` reads."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=metadata)
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def hf_tokenizer(tokenizer: Tokenizer):
    """Our tokenizer as a `tokenizers.Tokenizer` giving the same ids for the same text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if isinstance(tokenizer, BPETokenizer):
        return HFTokenizer.from_str(tokenizer.to_json())
    if isinstance(tokenizer, ByteTokenizer):
        # Each byte is its own token, id = byte value: GPT-2's byte-to-character table with no
        # merges, which is how `tokenizers` spells "raw UTF-8 bytes".
        table = _bytes_to_unicode()
        hf = HFTokenizer(models.BPE({table[b]: b for b in range(256)}, []))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    elif isinstance(tokenizer, CharTokenizer):
        hf = HFTokenizer(models.BPE({c: i for i, c in enumerate(tokenizer.chars)}, []))
        hf.decoder = decoders.Fuse()
    else:
        raise UserError(f"cannot export a '{tokenizer.kind}' tokenizer; supported: bpe, byte, char")
    hf.add_special_tokens([AddedToken(EOT, special=True)])
    assert hf.token_to_id(EOT) == tokenizer.eot_id, (hf.token_to_id(EOT), tokenizer.eot_id)
    return hf


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes onto printable characters (ByteLevel's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ----------------------------------------------------------------------------- init_from

# Keys a run may set apart from the folder's: they change no weight's shape.
_MAY_DIFFER = {"llama": {"block_size"}, "gpt2": set()}
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older GPT-2 files carry


def shape_from_hf(folder: str | Path) -> dict[str, Any]:
    """The `model:` settings of a `transformers` folder; what we cannot reproduce exactly is
    refused, naming it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"model.init_from: {folder} has no config.json (a transformers folder)")
    hf = json.loads(path.read_text())
    kind = hf.get("model_type")
    if kind == "llama":
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        if scaling or rope.get("rope_type", "default") != "default":
            raise UserError(f"model.init_from: {folder} uses RoPE scaling, which is not supported")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UserError(f"model.init_from: {folder} is not a plain Llama (activation, biases)")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise UserError(f"model.init_from: {folder} has a head size other than width/heads")
        return {
            "arch": "llama",
            "n_layer": hf["num_hidden_layers"],
            "n_head": heads,
            "n_kv_head": hf.get("num_key_value_heads") or heads,
            "n_embd": hf["hidden_size"],
            "ffn_hidden": hf["intermediate_size"],
            "block_size": hf["max_position_embeddings"],
            "tie_embeddings": hf.get("tie_word_embeddings", False),
            "rope_theta": float(hf.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "vocab_size": hf["vocab_size"],
        }
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act != "gelu":
            raise UserError(
                f"model.init_from: {folder} uses activation_function={act}; our gpt2 computes "
                "the exact GELU (gelu)"
            )
        if hf.get("layer_norm_epsilon", 1e-5) != 1e-5 or hf.get("n_inner") not in (
            None,
            4 * hf["n_embd"],
        ):
            raise UserError(f"model.init_from: {folder} differs from GPT-2's LayerNorm or MLP")
        return {
            "arch": "gpt2",
            "n_layer": hf["n_layer"],
            "n_head": hf["n_head"],
            "n_embd": hf["n_embd"],
            "block_size": hf["n_positions"],
            "bias": True,
            "vocab_size": hf["vocab_size"],
        }
    raise UserError(f"model.init_from: {folder} holds a '{kind}' model; supported: llama, gpt2")


def apply_init_from(cfg: RunConfig) -> RunConfig:
    """`cfg` with the model's shape and the tokenizer taken from `model.init_from` (a resolved
    config: the folder's path is absolute). A setting of the run's that contradicts the folder
    is refused in one line."""
    folder = cfg.model.init_from
    if not folder:
        return cfg
    shape = shape_from_hf(folder)
    explicit = cfg.model.model_fields_set
    if cfg.model.preset:
        raise UserError("model.init_from and model.preset both give the shape: keep one")
    for key, value in shape.items():
        mine = getattr(cfg.model, key)
        if key in explicit and mine != value and key not in _MAY_DIFFER[shape["arch"]]:
            raise UserError(
                f"model.{key}={mine!r} but model.init_from {folder} has {value!r}; unset it"
            )
    keep = {k: getattr(cfg.model, k) for k in _MAY_DIFFER[shape["arch"]] & explicit}
    tokenizer = Path(folder) / "tokenizer.json"
    if not tokenizer.is_file():
        raise UserError(f"model.init_from: {folder} has no tokenizer.json")
    if cfg.data.tokenizer.model_fields_set & {"kind", "path"}:
        raise UserError("data.tokenizer is taken from model.init_from: unset it")
    cfg = cfg.model_copy(deep=True)
    cfg.model = ModelConfig.model_validate({**cfg.model.model_dump(), **shape, **keep})
    cfg.data.tokenizer = TokenizerConfig(kind="bpe", path=str(tokenizer))
    return cfg


def load_hf_weights(model: CausalLM, folder: str | Path) -> None:
    """Loads the weights of a `transformers` folder into `model`, built to its shape."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in files:
        state |= load_file(str(folder / name))
    if isinstance(model, Llama):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    else:
        state = {
            (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v
            for k, v in state.items()
            if not k.endswith(_GPT2_BUFFERS)
        }
        state = {k: v.t().contiguous() if k.endswith(_CONV1D) else v for k, v in state.items()}
    for alias in tied_aliases(model):
        state.pop(alias, None)  # some folders store a tied head too
    try:
        load_model_state(model, state)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0:3]
        raise UserError(
            f"model.init_from: {folder} does not match the model: {' '.join(first)}"
        ) from None
