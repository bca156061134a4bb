import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_lm.cli import run as cli_run
from raytrain_lm.config import (
    RunConfig,
    flatten,
    load_config,
    parse_override,
    read_written_config,
    to_yaml,
)
from raytrain_lm.errors import UserError
from raytrain_lm.redaction import REDACTED, redact

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_experiment_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_defaults_are_the_demo():
    assert load_config(None) == load_config(ROOT / "experiments" / "demo.yaml")


def test_overrides_are_typed():
    cfg = load_config(
        None, ["optim.lr=3e-4", "model.n_layer=6", "data.sources=a.txt", "training.compile=true"]
    )
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.n_layer == 6
    assert cfg.data.sources == ["a.txt"]
    assert cfg.training.compile is True
    assert parse_override("data.sources=[a, b]") == (["data", "sources"], ["a", "b"])


LLAMA_TP = ["model.arch=llama", "parallel.strategy=fsdp"]  # where tensor parallelism applies
DILOCO = ["scaling.fault_tolerance=replicas", "parallel.sync=diloco"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=1"], "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        (["modle.n_layer=2"], "unknown key 'modle'; did you mean 'model'?"),
        (["training.global_batchsize=4"], "did you mean 'training.global_batch_size'?"),
        (["optim.lr=-1"], "invalid value for 'optim.lr'"),
        (["model.n_head=3"], "must be divisible by model.n_head"),
        (["training.global_batch_size=7"], "not divisible by scaling.num_workers (2)"),
        (["training.micro_batch_size=3"], "x training.micro_batch_size (3)"),
        (["training.precision=fp8"], "invalid value for 'training.precision'"),
        (["name=has space"], "invalid value for 'name'"),
        (["nonsense"], "not of the form"),
        # Two ranks on one GPU (NCCL: duplicate GPU), or a second GPU no rank uses.
        (["scaling.gpus_per_worker=0.5"], "each worker trains on exactly one GPU"),
        (["scaling.gpus_per_worker=2"], "each worker trains on exactly one GPU"),
        (["parallel.strategy=zero"], "invalid value for 'parallel.strategy'"),
        (["parallel.shard_size=2"], "applies to parallel.strategy=hsdp, not ddp"),
        (["parallel.tensor_parallel=2"], "parallel.tensor_parallel needs model.arch=llama"),
        (
            ["model.arch=llama", "parallel.tensor_parallel=2"],
            "composes with parallel.strategy=fsdp or hsdp, not ddp",
        ),
        (
            [
                *LLAMA_TP,
                "model.n_head=6",
                "model.n_embd=96",
                "parallel.tensor_parallel=4",
                "scaling.num_workers=4",
            ],
            "parallel.tensor_parallel=4 does not divide model.n_head (6)",
        ),
        (
            [
                *LLAMA_TP,
                "parallel.tensor_parallel=2",
                "scaling.min_workers=2",
                "scaling.max_workers=4",
            ],
            "scaling allows 3 workers, which do not split into groups of 2",
        ),
        (
            ["parallel.strategy=hsdp", "parallel.shard_size=2", "scaling.num_workers=3"],
            "every worker count the run may take must be a multiple of 2",
        ),
        (
            [*LLAMA_TP, "parallel.tensor_parallel=2", "scaling.balance={cpu: 1}"],
            "scaling.balance splits batches by rank: not with tensor_parallel",
        ),
        (
            ["scaling.fault_tolerance=replicas", "parallel.strategy=hsdp"],
            "keeps a whole model in every group",
        ),
        (["checkpoint.every_steps=often"], "a number of steps (at least 1) or auto"),
        (
            [*DILOCO, "checkpoint.every_steps=auto"],
            "with parallel.sync=diloco give a number of steps",
        ),
        (["budget.max_usd=100"], "budget.max_usd counts fault.price_per_hour: set it"),
        (["budget.deadline=soon"], "a duration is a number with d, h or m"),
        (["budget.deadline=0"], "a deadline is a positive duration"),
        (
            [*DILOCO, "diloco.sync_every=6", "diloco.fragments=4"],
            "make sync_every (6) a multiple of fragments",
        ),
        (
            [*DILOCO, "diloco.fragments=2", "diloco.full_sync_every=1"],
            "set it to 2 or more, or diloco.fragments=1",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: [1,\n")
    with pytest.raises(UserError, match="YAML syntax error at line"):
        load_config(bad)
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(scalar)


def test_flatten_gives_dotted_scalars():
    flat = flatten(load_config(None))
    assert flat["optim.lr"] == 1e-3
    assert flat["data.tokenizer.kind"] == "byte"


def test_resolved_makes_every_local_path_absolute_once(tmp_path, monkeypatch):
    """Ray's workers and trials run in folders of their own: every relative path a user can
    give is taken relative to the driver's working directory, URIs and builtins are kept."""
    notebook = tmp_path / "notebooks"
    notebook.mkdir()
    monkeypatch.chdir(notebook)
    given = load_config(
        None,
        [
            "output_dir=runs",
            "data.sources=[corpus/, ./a.txt, 'texts/*.txt', s3://bucket/x.jsonl, builtin:python-docs]",
            "data.cache_dir=../data",
            "data.prepared=data/0123",
            "data.tokenizer.path=tok/tokenizer.json",
            "tracking.uri=sqlite:///mlflow.db",
        ],
    )
    cfg = given.resolved()
    assert cfg.output_dir == str(notebook / "runs")
    assert cfg.data.sources == [
        str(notebook / "corpus"),
        str(notebook / "a.txt"),
        str(notebook / "texts" / "*.txt"),
        "s3://bucket/x.jsonl",
        "builtin:python-docs",
    ]
    assert cfg.data.cache_dir == str(tmp_path / "data")
    assert cfg.data.prepared == str(notebook / "data" / "0123")
    assert cfg.data.tokenizer.path == str(notebook / "tok" / "tokenizer.json")
    assert cfg.tracking.uri == f"sqlite:///{notebook / 'mlflow.db'}"
    assert given.output_dir == "runs" and given.tracking.uri == "sqlite:///mlflow.db"  # a copy
    assert cfg.resolved() == cfg  # resolving again changes nothing
    other = tmp_path / "elsewhere"
    assert given.resolved(other).output_dir == str(other / "runs")
    assert cfg.resolved(other) == cfg  # absolute already


@pytest.mark.parametrize(
    "uri, env, expected",
    [
        ("sqlite:///./x.db", None, "sqlite:///{cwd}/x.db"),
        ("sqlite:///db/x.db?timeout=30", None, "sqlite:///{cwd}/db/x.db?timeout=30"),
        ("sqlite:////abs/x.db", None, "sqlite:////abs/x.db"),
        ("sqlite:///:memory:", None, "sqlite:///:memory:"),
        ("http://127.0.0.1:5000", "sqlite:///env.db", "http://127.0.0.1:5000"),
        ("databricks", None, "databricks"),
        ("./mlruns", None, "{cwd}/mlruns"),
        (None, "sqlite:///env.db", "sqlite:///{cwd}/env.db"),
        (None, "https://mlflow.example.com", "https://mlflow.example.com"),
        (None, None, "sqlite:///{cwd}/mlflow.db"),
    ],
)
def test_resolved_tracking_store(tmp_path, monkeypatch, uri, env, expected):
    """`tracking.uri`, else $MLFLOW_TRACKING_URI, else mlflow.db here: written into the
    config, so that no worker reads the environment or its own working directory."""
    monkeypatch.chdir(tmp_path)
    if env is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    cfg = load_config(None, [f"tracking.uri='{uri}'"] if uri else [])
    assert cfg.resolved().tracking.uri == expected.format(cwd=tmp_path)
    disabled = load_config(None, ["tracking.enabled=false"]).resolved()
    assert disabled.tracking.uri is None


def test_config_yaml_hides_secrets_by_the_params_rule_and_reads_back():
    """The run's config.yaml (and its MLflow artifact) hides exactly what the MLflow params
    hide, at any depth and of any type, and still validates when read back (resume checks,
    `generate` and `eval` read it), the hidden settings left at their defaults."""
    cfg = load_config(
        None,
        [
            "scaling.label_selector.hf_token=hf_abc",
            "scaling.label_selector.zone=us-a",
            "scaling.worker_resources.license_key=2",
            "fault.price_per_hour.api_key=918273",
            "fault.price_per_hour.A100=1.5",
        ],
    )
    text = to_yaml(cfg)
    params = redact(flatten(cfg))
    for secret in ("hf_abc", "918273"):
        assert secret not in text and secret not in str(params)
    assert flatten(yaml.safe_load(text)) == params  # one rule for both
    assert params["fault.price_per_hour.api_key"] == REDACTED
    assert params["scaling.worker_resources.license_key"] == REDACTED
    back = read_written_config(yaml.safe_load(text))
    assert back.scaling.label_selector == {"zone": "us-a"}
    assert back.scaling.worker_resources == {}
    assert back.fault.price_per_hour == {"A100": 1.5}
    assert back.model == cfg.model and back.optim == cfg.optim


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "-5"], "argument --tokens: must be at least 1, got -5"),
        (["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
        (["--tokens", "1.5"], "argument --tokens: not an integer: '1.5'"),
        (["--top-k", "0"], "argument --top-k: must be at least 1, got 0"),
        (["--temperature", "-0.1"], "argument --temperature: must be at least 0, got -0.1"),
        (["--temperature", "warm"], "argument --temperature: not a number: 'warm'"),
        (["--sample-bytes", "0"], "argument --sample-bytes: must be at least 1, got 0"),
    ],
)
def test_cli_numbers_out_of_range_are_refused(args, message):
    command = ["tokenizer", "train", "--out", "tok"] if "--sample-bytes" in args else []
    with pytest.raises(UserError) as err:
        cli_run([*(command or ["generate", "--run", "anything"]), *args])
    assert str(err.value) == message


def test_sampling_refuses_the_values_the_cli_refuses():
    from raytrain_lm.generate import sample

    for bad, message in [
        ({"max_new_tokens": -5}, "max_new_tokens must be at least 1, got -5"),
        ({"top_k": 0}, "top_k must be at least 1"),
        ({"temperature": -1.0}, "temperature must be at least 0, got -1.0"),
    ]:
        with pytest.raises(UserError, match=message):
            sample(Path("no-checkpoint-needed"), "def ", **bad)


@pytest.fixture
def session_ray_env(ray_session) -> dict[str, str]:
    """The environment of a CLI that joins this session's Ray (as it would join a cluster
    through RAY_ADDRESS) instead of starting one: half a minute saved per command."""
    return {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}


def _cli(args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "raytrain_lm.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "missing.yaml"], "config file not found"),
        (["train", "bad.yaml"], "YAML syntax error"),
        (["train", "--set", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["train", "--optim.lr=-0.1"], "invalid value for 'optim.lr'"),
        (["train", "--set", "training.global_batch_size=33"], "not divisible"),
        (["train", "--set", "data.sources=empty.txt", "--set", "data.cache_dir=d"], "empty corpus"),
        (["train", "--set", "output_dir=/proc/forbidden"], "not writable"),
        (["prepare", "--set", "data.sources=nowhere/*.txt"], "input not found"),
        (["generate", "--run", "nope"], "no run or checkpoint named 'nope'"),
        (["generate", "--run", "nope", "--top-k", "0"], "argument --top-k: must be at least 1"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2_and_write_nothing(
    tmp_path, args, message, session_ray_env
):
    (tmp_path / "bad.yaml").write_text("optim: {lr: [\n")
    (tmp_path / "empty.txt").write_text("   \n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = _cli(args, tmp_path, session_ray_env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytrain-lm: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_config_show_prints_the_resolved_config(tmp_path):
    """What a run here would use: absolute paths, the store from the environment, no secret."""
    result = _cli(
        [
            "config",
            "show",
            str(ROOT / "experiments" / "nanogpt_cpu_baby.yaml"),
            "--optim.lr=5e-4",
            "--scaling.label_selector.auth_token=s3cr3t",
        ],
        tmp_path,
        env={**os.environ, "MLFLOW_TRACKING_URI": "sqlite:///./store.db"},
    )
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["optim"]["lr"] == 5e-4 and shown["data"]["tokenizer"]["kind"] == "char"
    assert shown["model"]["block_size"] == 64
    assert shown["output_dir"] == str(tmp_path / "runs")
    assert shown["data"]["cache_dir"] == str(tmp_path / "data")
    assert shown["tracking"]["uri"] == f"sqlite:///{tmp_path / 'store.db'}"
    assert "s3cr3t" not in result.stdout


def test_cli_refuses_a_corrupted_shard_before_training(tmp_path, session_ray_env):
    (tmp_path / "corpus.txt").write_text("some text to train on. " * 2000)
    args = ["--set", "data.sources=corpus.txt", "--set", "data.cache_dir=d"]
    assert _cli(["prepare", *args], tmp_path, session_ray_env).returncode == 0
    again = _cli(["prepare", *args], tmp_path, session_ray_env)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    shard = next((tmp_path / "d").glob("*/train-00000.parquet"))
    shard.write_bytes(shard.read_bytes()[:-4] + b"oops")
    result = _cli(["train", *args], tmp_path, session_ray_env)
    assert result.returncode == 2
    assert "shard train-00000.parquet is corrupted" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_tokenizer_train_then_prepare_then_mismatches_are_refused(tmp_path, session_ray_env):
    (tmp_path / "corpus.txt").write_text(
        "Byte-level BPE 训练 on a small sample. " * 3000, encoding="utf-8"
    )
    base = ["--set", "data.sources=corpus.txt", "--set", "data.cache_dir=d"]
    trained = _cli(
        ["tokenizer", "train", *base, "--set", "data.tokenizer.vocab_size=300", "--out", "tok"],
        tmp_path,
        session_ray_env,
    )
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    again = _cli(["tokenizer", "train", *base, "--out", "tok"], tmp_path, session_ray_env)
    assert again.returncode == 2 and "exists" in again.stderr

    bpe = [
        *base,
        "--set",
        "data.tokenizer.kind=bpe",
        "--set",
        "data.tokenizer.path=tok/tokenizer.json",
    ]
    prepared = _cli(["prepare", *bpe], tmp_path, session_ray_env)
    assert prepared.returncode == 0 and "bpe tokenizer, vocab 2" in prepared.stdout, prepared.stderr
    folder = next(p for p in (tmp_path / "d").iterdir() if not p.name.startswith("."))

    cases = [
        (["--set", "data.tokenizer.kind=char"], "uses a bpe tokenizer"),
        (
            ["--set", "data.tokenizer.kind=bpe", "--set", "model.vocab_size=100"],
            "smaller than the prepared data's vocabulary (2",
        ),
    ]
    for extra, message in cases:
        result = _cli(
            ["train", "--set", f"data.prepared={folder}", *extra], tmp_path, session_ray_env
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
    (tmp_path / "nothing").mkdir()
    result = _cli(["train", "--set", "data.prepared=nothing"], tmp_path, session_ray_env)
    # the error names the folder as resolved (relative to the working directory)
    assert result.returncode == 2 and f"no manifest.json in {tmp_path / 'nothing'}" in result.stderr
    assert not (tmp_path / "runs").exists()
