"""`raytrain-lm`: train, sweep, prepare, config show, generate, export, eval,
submit/status/logs/stop, cluster.

Overrides: `--set section.key=value` (repeatable) or the short form `--section.key=value`.
User errors print one line and exit with status 2; nothing is written before validation.
"""

from __future__ import annotations

import argparse
import json
import sys

from raytrain_lm.errors import InterruptedBeforeStart, UserError, find_user_error

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # stopped before the end (resumable), as after Ctrl-C
STOP_OUTCOMES = {
    "stopping": "stopping: the run checkpoints at its next step, then ends (resubmit to "
    "resume); `raytrain-lm stop {job}` again ends it at once, without that checkpoint",
    "forced": "ended at once: steps since the run's last checkpoint are lost",
    "already finished": "already finished",
}


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain-lm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "config", nargs="?", help="YAML file in experiments/ (default: embedded demo)"
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override one setting, e.g. --set optim.lr=3e-4 (repeatable)",
        )

    with_config(commands.add_parser("train", help="train (or resume) a run"))
    with_config(commands.add_parser("prepare", help="tokenize text into Parquet token shards"))
    planner = commands.add_parser("plan", help="what a run will cost, before it starts")
    with_config(planner)
    planner.add_argument("--tokens", type=float, help="default: max_steps x the global batch")
    planner.add_argument("--deadline", help="e.g. 36h, 2d")
    planner.add_argument("--budget", type=_NON_NEGATIVE_FLOAT, help="USD")
    planner.add_argument("--from", dest="from_run", help="calibrate from this run (name or dir)")
    planner.add_argument("--catalog", help="price catalog YAML (default: the shipped example)")
    planner.add_argument("--rows", type=_POSITIVE_INT, default=15, help="candidates shown")
    planner.add_argument("--json", action="store_true", help="the whole plan as JSON")
    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_commands = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=_Parser
    )
    tok_train = tokenizer_commands.add_parser(
        "train", help="train byte-level BPE on a sample of data.sources"
    )
    with_config(tok_train)
    tok_train.add_argument("--out", required=True, help="where to write tokenizer.json")
    tok_train.add_argument(
        "--sample-bytes",
        type=_POSITIVE_INT,
        default=20_000_000,
        help="train on the first this many bytes of the sources",
    )
    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(
        dest="config_command", required=True, parser_class=_Parser
    )
    with_config(config_commands.add_parser("show", help="print the resolved config"))
    gen = commands.add_parser("generate", help="sample text from a run or checkpoint")
    gen.add_argument("--run", required=True, help="run name, run folder or checkpoint folder")
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
    export = commands.add_parser(
        "export", help="write a run's model as a Hugging Face transformers directory"
    )
    export.add_argument("run", help="run name, run folder or checkpoint folder")
    export.add_argument("--format", default="hf", choices=["hf"], help="hf: transformers")
    export.add_argument("--out", required=True, help="folder to create (must not hold files)")
    export.add_argument("--output-dir", default="runs")
    evaluation = commands.add_parser(
        "eval", help="a run's loss and perplexity on any text, logged to its MLflow run"
    )
    evaluation.add_argument("run", help="run name, run folder or checkpoint folder")
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
    _add_cluster_commands(commands)
    return parser


def _add_cluster_commands(commands) -> None:
    def with_address(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--address",
            help="job server (dashboard) URL; default $RAY_API_SERVER_ADDRESS, a `cluster up` "
            "cluster, then http://127.0.0.1:8265",
        )

    sub = commands.add_parser("submit", help="run `train` as a Ray job on a cluster")
    sub.add_argument("config", nargs="?", help="YAML file inside the working dir")
    sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    with_address(sub)
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
    for name, text in (
        ("status", "show a job's state"),
        ("logs", "print a job's logs"),
        ("stop", "stop a job"),
    ):
        p = commands.add_parser(name, help=text)
        p.add_argument("job_id")
        with_address(p)
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
    cdown = cluster_commands.add_parser("down", help="stop it and its nodes")
    for p in (cup, cdown):
        p.add_argument("--dir", default="/tmp/raytrain-lm-cluster", help="Ray's temp dir for it")


def _run_cluster_command(args) -> int:
    if args.command == "cluster":
        from raytrain_lm.clusters import autoscaling

        if args.cluster_command == "up":
            state = autoscaling.up(args.config, args.dir)
            print(f"local cluster up: Ray at {state['address']}, jobs at {state['dashboard']}")
            print(
                f"  submit: raytrain-lm submit experiments/demo.yaml --address {state['dashboard']}"
            )
            print(f"  status: RAY_AUTH_MODE=token ray status --address {state['address']}")
            print(f"  stop:   raytrain-lm cluster down --dir {args.dir}")
            return 0
        ended = autoscaling.down(args.dir)
        print(f"local cluster down: ended {ended} processes")
        return 0

    from raytrain_lm.clusters import jobs

    if args.command == "submit":
        submitted = jobs.submit(
            args.config, args.set, args.address, args.working_dir, args.storage, args.job_id
        )
        job, where = submitted["job_id"], submitted["address"]
        print(f"submitted job {job} to {where}")
        print(f"  entrypoint: {submitted['entrypoint']}")
        print(f"  storage:     {submitted['storage']} (relative runs, data and mlflow.db)")
        print(f"  follow logs: raytrain-lm logs {job} --follow --address {where}")
        print(f"  state:       raytrain-lm status {job} --address {where}")
        print(f"  stop:        raytrain-lm stop {job} --address {where}")
        if args.follow:
            jobs.logs(job, args.address, follow=True)
            state = jobs.status(job, args.address)["status"]
            print(f"job {job}: {state}")
            return 0 if state == "SUCCEEDED" else 1
        return 0
    if args.command == "status":
        info = jobs.status(args.job_id, args.address)
        print(
            f"{info['job_id']}: {info['status']}"
            + (f" ({info['message']})" if info["message"] else "")
        )
        return 0
    if args.command == "logs":
        text = jobs.logs(args.job_id, args.address, follow=args.follow)
        if text is not None:
            print(text, end="")
        return 0
    outcome = jobs.stop(args.job_id, args.address)
    print(f"{args.job_id}: " + STOP_OUTCOMES[outcome].format(job=args.job_id))
    return 0


def run(argv: list[str]) -> int:
    from raytrain_lm.config import load_config, to_yaml

    argv, short_overrides = _split_overrides(argv)
    args = _parser().parse_args(argv)
    if args.command in ("submit", "status", "logs", "stop", "cluster"):
        if args.command == "submit":
            args.set = [*args.set, *short_overrides]
        elif short_overrides:
            raise UserError(f"`{args.command}` takes no config overrides")
        return _run_cluster_command(args)
    if args.command == "sweep":
        return _run_sweep_command(args, short_overrides)
    if args.command == "export":
        from raytrain_lm.huggingface import export

        out = export(args.run, args.out, args.output_dir, args.format)
        print(f"[raytrain-lm] exported {args.run} to {out} (load with transformers' "
              f"AutoModelForCausalLM.from_pretrained)")  # fmt: skip
        return 0
    if args.command == "eval":
        from raytrain_lm.api import evaluate

        result = evaluate(
            args.run,
            args.data,
            workers=args.workers,
            output_dir=args.output_dir,
            name=args.name,
            batch_size=args.batch_size,
            max_bytes=args.max_bytes,
        )
        print(
            f"{result['name']}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
            f"over {result['tokens']:,} tokens (step {result['step']} of run '{result['run']}')"
        )
        print("result: " + json.dumps(result))
        return 0
    if args.command == "plan":
        from raytrain_lm.costs import plan
        from raytrain_lm.costs.report import render

        cfg = load_config(args.config, [*args.set, *short_overrides])
        result = plan(cfg, args.tokens, args.deadline, args.budget, args.from_run, args.catalog)
        print(json.dumps(result, indent=1) if args.json else render(result, args.rows))
        return 0
    if args.command == "generate":
        from raytrain_lm.generate import resolve_checkpoint, sample

        checkpoint = resolve_checkpoint(args.run, args.output_dir)
        print(sample(checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
        return 0

    # Every path as the run will use it: what `config show` prints, what `prepare` fingerprints
    # (a tokenizer path spelled differently would otherwise prepare the same data twice).
    cfg = load_config(args.config, [*args.set, *short_overrides]).resolved()
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    if args.command == "prepare":
        from raytrain_lm.data.prepare import prepare

        prepared = prepare(cfg.data)
        m = prepared.manifest
        state = "prepared" if prepared.created else "already prepared (nothing to do)"
        if m.curation is not None and not prepared.created:  # else prepare printed it
            from raytrain_lm.data.curate.report import curation_table

            print(curation_table(m.curation))
        print(
            f"{state}: {prepared.directory} ({m.splits['train'].tokens:,} train / "
            f"{m.splits['val'].tokens:,} val tokens, {m.documents:,} documents, "
            f"{m.tokenizer_kind} tokenizer, vocab {m.vocab_size})"
        )
        return 0
    if args.command == "tokenizer":
        return _train_tokenizer(cfg, args.out, args.sample_bytes)

    from raytrain_lm.api import train

    summary = train(cfg)
    print("summary: " + json.dumps(summary))
    if summary.get("mlflow_run_id"):
        from raytrain_lm.tracking.ui import where_to_look

        print(where_to_look(cfg.tracking.uri, summary["mlflow_run_id"]))
    return EXIT_INTERRUPTED if summary["stopped"] else 0


def _run_sweep_command(args, short_overrides: list[str]) -> int:
    if args.target == "report":
        if not args.name:
            raise UserError("usage: raytrain-lm sweep report NAME")
        if args.set or short_overrides:
            raise UserError("`sweep report` takes no config overrides")
        from raytrain_lm.api import sweep_report

        result = sweep_report(args.name, args.output_dir, args.out)
        print(result["table"])
        print(f"report: {result['png']}")
        return 0
    if args.name:
        raise UserError(f"unexpected argument '{args.name}' after the sweep file")
    from raytrain_lm.api import sweep

    summary = sweep(args.target, [*args.set, *short_overrides])
    best = next((r for r in summary["ranked"] if r["val_loss"] is not None), None)
    if best is not None:
        print(f"best: {best['run_name']} val_loss {best['val_loss']:.4f} ({best['params']})")
    print(f"report: {summary['report']}")
    return EXIT_INTERRUPTED if summary["interrupted"] else 0


def _train_tokenizer(cfg, out: str, sample_bytes: int) -> int:
    from pathlib import Path

    from raytrain_lm.data.prepare_tokenizer import train_bpe
    from raytrain_lm.runtime import ensure_local_ray
    from raytrain_lm.tokenization import TOKENIZER_FILE

    target = Path(out)
    if target.suffix != ".json":
        target = target / TOKENIZER_FILE
    if target.exists():
        raise UserError(f"{target} exists; remove it or choose another --out")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {target.parent}: {exc.strerror}") from None
    ensure_local_ray()
    tokenizer = train_bpe(cfg.data, sample_bytes=sample_bytes)
    target.write_text(tokenizer.to_json(), encoding="utf-8")
    print(f"trained byte-level BPE (vocab {tokenizer.vocab_size}) -> {target}")
    print(f"use it with: --set data.tokenizer.kind=bpe --set data.tokenizer.path={target}")
    return 0


def _quiet_logs() -> None:
    """The CLI speaks for itself: Ray's INFO chatter stays in Ray's log files."""
    import logging
    import os

    os.environ.setdefault("RAY_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    for name in ("ray.data", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    _quiet_logs()
    try:
        code = run(sys.argv[1:])
    except InterruptedBeforeStart as nothing_started:
        print(f"raytrain-lm: {nothing_started}", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("raytrain-lm: interrupted; run the same command again to resume", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as exc:
        # A UserError raised in a Ray task, Train worker or Tune trial arrives wrapped.
        found = find_user_error(exc)
        if found is None:
            raise
        print(f"raytrain-lm: error: {found}", file=sys.stderr)
        code = EXIT_USER_ERROR
    sys.exit(code)


if __name__ == "__main__":
    main()
