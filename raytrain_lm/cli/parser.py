"""`raytrain-lm`: train, sweep, prepare, config show, generate, export, eval,
submit/status/logs/stop, cluster, tracking.

Overrides: `--set section.key=value` (repeatable) or the short form `--section.key=value`.
User errors print one line and exit with status 2; nothing is written before validation.
"""

from __future__ import annotations

import argparse

from raytrain_lm.cli.tracking_commands import add_tracking_commands
from raytrain_lm.errors import UserError


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Moves `--section.key=value` / `--section.key value` into `--set` form."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            if "=" in arg:
                overrides.append(arg[2:])
            elif i + 1 < len(argv):
                overrides.append(f"{arg[2:]}={argv[i + 1]}")
                i += 1
            else:
                raise UserError(f"override {arg} needs a value")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user error
        raise UserError(message)


def _at_least(kind: type, minimum: float):
    """An argparse `type` reading a `kind` (int or float) no smaller than `minimum`: every
    numeric flag declares its range with one, so a bad value is a one-line error."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    return parse


_POSITIVE_INT = _at_least(int, 1)
_NON_NEGATIVE_FLOAT = _at_least(float, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain-lm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _with_config(commands.add_parser("train", help="train (or resume) a run"))
    _with_config(commands.add_parser("prepare", help="tokenize text into Parquet token shards"))
    _add_plan(commands)
    _add_tokenizer(commands)
    _add_config(commands)
    _add_generate(commands)
    _add_promote(commands)
    _add_export(commands)
    _add_eval(commands)
    _add_sweep(commands)
    _add_cluster_commands(commands)
    _add_audit(commands)
    add_tracking_commands(commands, _Parser, _POSITIVE_INT)
    return parser


def _with_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML file in experiments/ (default: embedded demo)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set optim.lr=3e-4 (repeatable)",
    )


def _add_plan(commands) -> None:
    planner = commands.add_parser("plan", help="what a run will cost, before it starts")
    _with_config(planner)
    planner.add_argument("--tokens", type=float, help="default: max_steps x the global batch")
    planner.add_argument("--deadline", help="e.g. 36h, 2d")
    planner.add_argument("--budget", type=_NON_NEGATIVE_FLOAT, help="USD")
    planner.add_argument("--from", dest="from_run", help="calibrate from this run (name or dir)")
    planner.add_argument("--catalog", help="price catalog YAML (default: the shipped example)")
    planner.add_argument("--rows", type=_POSITIVE_INT, default=15, help="candidates shown")
    planner.add_argument("--json", action="store_true", help="the whole plan as JSON")


def _add_tokenizer(commands) -> None:
    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_commands = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=_Parser
    )
    tok_train = tokenizer_commands.add_parser(
        "train", help="train byte-level BPE on a sample of data.sources"
    )
    _with_config(tok_train)
    tok_train.add_argument("--out", required=True, help="where to write tokenizer.json")
    tok_train.add_argument(
        "--sample-bytes",
        type=_POSITIVE_INT,
        default=20_000_000,
        help="train on the first this many bytes of the sources",
    )


def _add_config(commands) -> None:
    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(
        dest="config_command", required=True, parser_class=_Parser
    )
    _with_config(config_commands.add_parser("show", help="print the resolved config"))


RUN_HELP = "run name, run folder, checkpoint folder or models:/NAME@ALIAS"


def _add_promote(commands) -> None:
    promote = commands.add_parser(
        "promote", help="register one of a run's checkpoints in MLflow's Model Registry"
    )
    promote.add_argument("run", help="run name or run folder")
    which = promote.add_mutually_exclusive_group()
    which.add_argument("--step", type=_POSITIVE_INT, help="the checkpoint of this step")
    which.add_argument(
        "--best", choices=["val_loss", "train_loss"], help="the checkpoint with the lowest"
    )
    promote.add_argument("--name", required=True, help="the registered model's name")
    promote.add_argument("--alias", default="champion", help="alias of the new version")
    promote.add_argument("--output-dir", default="runs")


def _add_audit(commands) -> None:
    audit = commands.add_parser(
        "audit", help="who submitted, stopped, swept, promoted or started what, and when"
    )
    audit.add_argument("--run", help="this run's records only")
    audit.add_argument("--since", help="a duration back (30m, 2h, 7d) or a date (2026-12-07)")
    audit.add_argument(
        "--storage", default=".", help="where the runs are: a folder (default .) or s3://..."
    )


def _add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="sample text from a run or checkpoint")
    gen.add_argument("--run", required=True, help=RUN_HELP)
    gen.add_argument("--prompt", default="")
    gen.add_argument("--tokens", type=_POSITIVE_INT, default=200, help="tokens to generate")
    gen.add_argument(
        "--temperature", type=_NON_NEGATIVE_FLOAT, default=0.8, help="0: the likeliest token"
    )
    gen.add_argument(
        "--top-k", type=_POSITIVE_INT, default=50, help="sample among the k likeliest tokens"
    )
    gen.add_argument("--seed", type=int, default=0, help="the same seed gives the same text")
    gen.add_argument("--output-dir", default="runs")


def _add_export(commands) -> None:
    export = commands.add_parser(
        "export", help="write a run's model as a Hugging Face transformers directory"
    )
    export.add_argument("run", help=RUN_HELP)
    export.add_argument("--format", default="hf", choices=["hf"], help="hf: transformers")
    export.add_argument("--out", required=True, help="folder to create (must not hold files)")
    export.add_argument("--output-dir", default="runs")


def _add_eval(commands) -> None:
    evaluation = commands.add_parser(
        "eval", help="a run's loss and perplexity on any text, logged to its MLflow run"
    )
    evaluation.add_argument("run", help=RUN_HELP)
    evaluation.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="SOURCE",
        help="text files, folders, globs or builtin: corpora, as data.sources takes them",
    )
    evaluation.add_argument(
        "--workers", type=_POSITIVE_INT, default=1, help="Ray Train workers to score with"
    )
    evaluation.add_argument(
        "--name", help="the metrics' name in MLflow: eval/NAME/loss (default: from --data)"
    )
    evaluation.add_argument(
        "--batch-size",
        type=_POSITIVE_INT,
        help="sequences per forward pass (default: the run's training.micro_batch_size, else 8)",
    )
    evaluation.add_argument(
        "--max-bytes", type=_POSITIVE_INT, help="read at most this many bytes of text (default all)"
    )
    evaluation.add_argument("--output-dir", default="runs")


def _add_sweep(commands) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="run (or resume) a hyperparameter sweep: `sweep SWEEP.yaml`, `sweep report NAME`",
    )
    sweep.add_argument("target", help="sweep YAML file, or `report`")
    sweep.add_argument("name", nargs="?", help="with `report`: the sweep's name")
    sweep.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a base setting"
    )
    sweep.add_argument("--output-dir", default="runs", help="with `report`: where sweeps live")
    sweep.add_argument("--out", help="with `report`: PNG path (default <sweep dir>/report.png)")


def _with_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        help="job server (dashboard) URL; default $RAY_API_SERVER_ADDRESS, a `cluster up` "
        "cluster, then http://127.0.0.1:8265",
    )


def _add_cluster_commands(commands) -> None:
    _add_submit(commands)
    for name, text in (
        ("status", "show a job's state"),
        ("logs", "print a job's logs"),
        ("stop", "stop a job"),
    ):
        p = commands.add_parser(name, help=text)
        p.add_argument("job_id")
        _with_address(p)
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true")
    cluster = commands.add_parser(
        "cluster", help="a local autoscaling cluster (cluster/local.yaml)"
    )
    cluster_commands = cluster.add_subparsers(
        dest="cluster_command", required=True, parser_class=_Parser
    )
    cup = cluster_commands.add_parser("up", help="start it: head now, fake GPU nodes on demand")
    cup.add_argument("--config", default="cluster/local.yaml")
    cup.add_argument(
        "--tracking-home",
        default="~/raytrain-lm/tracking",
        help="the MLflow server's records, kept from one `up` to the next (default "
        "~/raytrain-lm/tracking, as `tracking serve`'s)",
    )
    cup.add_argument("--tracking-port", type=_POSITIVE_INT, default=5000)
    cup.add_argument(
        "--no-tracking",
        action="store_true",
        help="no MLflow server: jobs log to sqlite files (or their config's tracking.uri)",
    )
    cdown = cluster_commands.add_parser("down", help="stop it and its nodes")
    for p in (cup, cdown):
        p.add_argument("--dir", default="/tmp/raytrain-lm-cluster", help="Ray's temp dir for it")


def _add_submit(commands) -> None:
    sub = commands.add_parser("submit", help="run `train` as a Ray job on a cluster")
    sub.add_argument("config", nargs="?", help="YAML file inside the working dir")
    sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _with_address(sub)
    sub.add_argument("--working-dir", default=".", help="uploaded to the cluster (default .)")
    sub.add_argument(
        "--storage",
        default=None,
        help="where run output and prepared data go: a bucket (s3://BUCKET/prefix, "
        "gs://BUCKET/prefix; what a cluster of several nodes needs) or a folder on the head "
        "(default: the working dir on a cluster running on this machine, as `cluster up`'s; "
        "else $HOME/raytrain-lm)",
    )
    sub.add_argument("--job-id", help="submission id (default <run name>-<time>)")
    sub.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
