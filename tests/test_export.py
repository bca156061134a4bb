"""Export to Hugging Face `transformers` (raytrain_lm/huggingface.py), read back by `transformers`
itself: the suite's trained llama (sharded) and gpt2 (DDP) runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from raytrain_lm import cli
from raytrain_lm.checkpoints import complete_checkpoints
from raytrain_lm.errors import UserError
from raytrain_lm.generate import load_model
from raytrain_lm.huggingface import export

PROMPT = "def main(argv):\n    ret"  # 24 byte tokens; with 8 more, the runs' 32 of context


def _run_of(arch: str, request) -> tuple[Path, str]:
    if arch == "llama":
        return request.getfixturevalue("learned_run")["output_dir"], "learns"
    return request.getfixturevalue("world_size_runs")["output_dir"], "uninterrupted"


def _read_back(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(
        folder
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_trained_run_exports_to_transformers(arch, request, tmp_path, capsys):
    """`raytrain-lm export RUN --format hf --out DIR` as a user types it; `transformers` reads
    the folder: same token ids, logits within 1e-4, greedy generation token for token."""
    runs, name = _run_of(arch, request)
    out = tmp_path / "hf"
    code = cli.run(["export", name, "--format", "hf", "--out", str(out), "--output-dir", str(runs)])
    assert code == 0 and "exported" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    expected = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[arch]
    assert config["architectures"] == [expected]
    assert {"model.safetensors", "generation_config.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }

    ours, tokenizer = load_model(complete_checkpoints(runs / name)[-1])
    theirs, their_tokenizer = _read_back(out)
    ids = tokenizer.encode(PROMPT)
    assert their_tokenizer(PROMPT)["input_ids"] == ids
    assert their_tokenizer.decode(ids) == PROMPT
    x = torch.tensor([ids])
    with torch.no_grad():
        gap = (ours(x, x)[0] - theirs(x).logits).abs().max().item()
    assert gap < 1e-4, gap
    new = ours.block_size - len(ids)
    greedy = ours.generate(x, new, temperature=0.0)
    their_greedy = theirs.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert greedy.tolist() == their_greedy.tolist()


def test_a_sharded_checkpoint_exports_in_shards_and_refusals_write_nothing(learned_run, tmp_path):
    """The llama run's step-20 checkpoint holds only DCP shards: export gathers them. Weights
    over the size limit are split with the index `transformers` reads."""
    middle = complete_checkpoints(learned_run["output_dir"] / "learns")[0]
    assert not (Path(middle) / "model.safetensors").exists()
    out = export(str(middle), tmp_path / "split", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours, tokenizer = load_model(middle)
    theirs, _ = _read_back(out)
    x = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert (ours(x, x)[0] - theirs(x).logits).abs().max().item() < 1e-4

    # A folder with files in it is refused (in one line, exit 2, from the CLI's main) and left
    # as it was.
    with pytest.raises(UserError, match="is not an empty folder; choose another --out"):
        cli.run(["export", str(middle), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {*index["weight_map"].values(), "config.json", "generation_config.json",
         "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json",
         "tokenizer_config.json"}
    )  # fmt: skip


def test_generate_takes_the_run_beside_an_export_folder_of_its_name(
    request, tmp_path, monkeypatch, capsys
):
    """A user exports run `hf` into `hf/` where they stand, then samples from the run by name:
    the export folder (neither a run nor a checkpoint) gives way to the run under runs/, and
    without such a run the error says what the folder is."""
    runs, name = _run_of("gpt2", request)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs / name, tmp_path / "runs" / "hf")
    assert cli.run(["export", "hf", "--out", "hf"]) == 0
    capsys.readouterr()
    assert cli.run(["generate", "--run", "hf", "--prompt", "def ", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")

    shutil.rmtree(tmp_path / "runs" / "hf")
    with pytest.raises(UserError) as err:
        cli.run(["generate", "--run", "hf"])
    assert str(err.value) == (
        "hf is a Hugging Face transformers folder (an export), not a run or a checkpoint, and "
        "runs/ holds no run named 'hf'"
    )
