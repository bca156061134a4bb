"""`raytrain-lm eval RUN --data SOURCES` (raytrain_lm/text_eval.py) on the suite's trained llama
run: the figure Ray Train workers compute and log equals one computed here by hand."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from raytrain_lm import cli
from raytrain_lm.checkpoints import complete_checkpoints
from raytrain_lm.data.manifest import Manifest
from raytrain_lm.generate import load_model

# Text the run never trained on (it trained on the standard library): our own source.
TEXT = Path(__file__).parents[1] / "raytrain_lm" / "trainer" / "driver" / "launch.py"


def _by_hand(checkpoint: Path, data_dir: str) -> tuple[float, int]:
    """Mean token loss over every held-out sequence, one process, no Ray."""
    model, _ = load_model(checkpoint)
    manifest = Manifest.load(data_dir)
    assert manifest.splits["train"].tokens == 0  # every token of eval text is held out
    from raytrain_lm.data.stream import validation_batches

    losses, sequences = [], 0
    with torch.no_grad():
        for tokens in validation_batches(data_dir, manifest, model.block_size, None, 0, 1, 64):
            t = torch.from_numpy(tokens.astype(np.int64))
            losses.append(float(model(t[:, :-1], t[:, 1:])[1]) * len(t))
            sequences += len(t)
    return sum(losses) / sequences, sequences * model.block_size


def test_eval_scores_any_text_on_two_workers_and_logs_it(
    learned_run, shared_dirs, tmp_path, monkeypatch, capsys
):
    runs = tmp_path / "runs"  # a copy: the shared run stays as it was (its MLflow run is one)
    shutil.copytree(learned_run["output_dir"] / "learns", runs / "learns")
    text = tmp_path / "held.out.py"
    shutil.copy(TEXT, text)
    # As a user types it: paths relative to where they are (the workers run elsewhere).
    monkeypatch.chdir(tmp_path)
    code = cli.run(["eval", "learns", "--data", "held.out.py", "--workers", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.split("result: ", 1)[1].splitlines()[0])
    assert result["name"] == "held" and result["step"] == 40 and result["workers"] == 2
    assert f"held: loss {result['loss']:.4f}" in out

    loss, tokens = _by_hand(complete_checkpoints(runs / "learns")[-1], result["data"])
    assert result["tokens"] == tokens > 0.9 * text.stat().st_size  # byte tokens
    assert abs(result["loss"] - loss) < 1e-5, (result["loss"], loss)
    assert math.isclose(result["perplexity"], math.exp(loss), rel_tol=1e-5)
    # The model learned Python: unseen Python is far likelier than uniform bytes (ln 256).
    assert loss < 0.8 * math.log(256)

    client = MlflowClient(tracking_uri=f"sqlite:///{shared_dirs['mlflow']}")
    run_id = learned_run["summary"]["mlflow_run_id"]
    assert result["mlflow_run_id"] == run_id
    logged = client.get_metric_history(run_id, "eval/held/loss")
    assert [(m.step, round(m.value, 6)) for m in logged] == [(40, round(result["loss"], 6))]
    assert client.get_run(run_id).info.status == "FINISHED"  # left as the run ended
    artifacts = [a.path for a in client.list_artifacts(run_id, "evaluations")]
    assert artifacts == ["evaluations/held-step40.json"]
    # Ray Train's records of it sit beside the run's checkpoints, where every node can reach
    assert len(list((runs / "learns" / "evaluations").iterdir())) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "nowhere", "--data", "x.txt"], "no run or checkpoint named 'nowhere'"),
        (["eval", "learns", "--data", "/no/such/text.txt"], "/no/such/text.txt"),
        (["eval", "learns", "--data", "x.txt", "--workers", "0"], "must be at least 1"),
        (["eval", "learns", "--data", "x.txt", "--name", "a b"], "eval name 'a b'"),
        (["eval", "learns"], "--data"),
    ],
)
def test_eval_refuses_in_one_line(argv, message, learned_run, monkeypatch, capsys):
    """As `raytrain-lm` reports them (cli.main): one line, exit 2, before any work."""
    argv = ["raytrain-lm", *argv, "--output-dir", str(learned_run["output_dir"])]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_held_out_text_keeps_the_given_alphabet(ray_session, tmp_path):
    """Eval text is tokenized with the run's tokenizer, never one built from it: a char
    model's alphabet cannot grow, so text outside it is refused in one line."""
    from raytrain_lm.config import DataConfig
    from raytrain_lm.data.prepare import prepare
    from raytrain_lm.errors import UserError
    from raytrain_lm.tokenization import CharTokenizer

    text = tmp_path / "t.txt"
    text.write_text("abba cab " * 300)
    cfg = DataConfig(
        sources=[str(text)], cache_dir=str(tmp_path / "data"), tokenizer={"kind": "char"}
    )
    alphabet = CharTokenizer("abcd ")
    prepared = prepare(cfg, progress=False, tokenizer=alphabet, held_out_only=True)
    splits = prepared.manifest.splits
    assert splits["train"].tokens == 0 and splits["val"].tokens == 2701  # with end-of-text
    assert prepared.manifest.tokenizer_fingerprint == alphabet.fingerprint
    text.write_text("abba cab\n" * 300)
    with pytest.raises(UserError, match="300 characters of .* are not in the char tokenizer"):
        prepare(cfg, progress=False, tokenizer=alphabet, held_out_only=True)
