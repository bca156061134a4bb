"""`model.init_from`: a run that starts from a `transformers` folder (raytrain_lm/huggingface.py):
a tiny random Llama made and saved by `transformers` itself, then trained, then exported and
read back. (Resuming is the same for every run: from its own checkpoints.)"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

import raytrain_lm
from raytrain_lm.config import load_config
from raytrain_lm.errors import UserError
from raytrain_lm.generate import load_model
from raytrain_lm.huggingface import apply_init_from, hf_tokenizer, load_hf_weights
from raytrain_lm.models import build_model
from raytrain_lm.tokenization import ByteTokenizer

TEXT = "import os\ndef f(x):\n    return x"


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random LlamaForCausalLM with a byte tokenizer, saved as transformers saves it
    (an RMSNorm epsilon and an untied head unlike our defaults)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf-llama")
    config = LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    hf_tokenizer(ByteTokenizer()).save(str(folder / "tokenizer.json"))
    return folder, model


def _resolved(overrides: list[str]):
    return apply_init_from(load_config(None, overrides).resolved())


def test_the_folder_gives_shape_tokenizer_and_identical_logits(hf_llama):
    folder, theirs = hf_llama
    cfg = _resolved([f"model.init_from={folder}"])
    assert (cfg.model.arch, cfg.model.n_kv_head, cfg.model.norm_eps) == ("llama", 2, 1e-6)
    assert not cfg.model.tie_embeddings and cfg.model.vocab_size == 257
    assert cfg.data.tokenizer.path == str(folder / "tokenizer.json")
    ours = build_model(cfg.model, 257)
    load_hf_weights(ours, folder)
    ids = torch.tensor([ByteTokenizer().encode(TEXT)])
    with torch.no_grad():
        assert torch.allclose(ours.eval()(ids, ids)[0], theirs(ids).logits, atol=1e-5)

    with pytest.raises(UserError, match="model.n_layer=3 but model.init_from .* has 2; unset it"):
        _resolved([f"model.init_from={folder}", "model.n_layer=3"])
    with pytest.raises(UserError, match="data.tokenizer is taken from model.init_from"):
        _resolved([f"model.init_from={folder}", "data.tokenizer.kind=char"])
    assert _resolved([f"model.init_from={folder}", "model.block_size=16"]).model.block_size == 16


def test_a_run_from_a_transformers_folder_trains_and_exports_back(
    hf_llama, ray_session, shared_dirs, tmp_path
):
    folder, _ = hf_llama
    overrides = [
        *(o for o in TINY if not o.startswith("model.")),
        f"output_dir={tmp_path / 'runs'}",
        f"data.cache_dir={shared_dirs['data']}",
        f"tracking.uri=sqlite:///{shared_dirs['mlflow']}",
        "name=from-hf",
        f"model.init_from={folder}",
        "scaling.num_workers=1",
        "training.max_steps=4",
        "training.eval_every=4",
    ]
    trained = raytrain_lm.train(load_config(None, overrides), sample=False)
    assert trained["steps"] == 4
    saved = load_config(tmp_path / "runs" / "from-hf" / "config.yaml")
    assert saved.model.init_from == str(folder) and saved.model.norm_eps == 1e-6

    out = raytrain_lm.export("from-hf", tmp_path / "back", output_dir=tmp_path / "runs")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, tokenizer = load_model(trained["checkpoint"])
    ids = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        gap = (ours(ids, ids)[0] - again(ids).logits).abs().max().item()
    assert gap < 1e-4, gap
    weights_moved = any(
        not torch.equal(p, q)
        for p, q in zip(again.parameters(), hf_llama[1].parameters(), strict=True)
    )
    assert weights_moved  # trained: not the folder's weights handed back
