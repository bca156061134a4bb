"""`raytrain-lm`: train, prepare, config show, generate.

Overrides: `--set section.key=value` (repeatable) or the short form `--section.key=value`.
User errors print one line and exit with status 2; nothing is written before validation.
"""

from __future__ import annotations

import argparse
import json
import sys

from raytrain_lm.errors import UserError

EXIT_USER_ERROR = 2


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
    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_commands = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=_Parser
    )
    tok_train = tokenizer_commands.add_parser(
        "train", help="train byte-level BPE on a sample of data.sources"
    )
    with_config(tok_train)
    tok_train.add_argument("--out", required=True, help="where to write tokenizer.json")
    tok_train.add_argument("--sample-bytes", type=int, default=20_000_000)
    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(
        dest="config_command", required=True, parser_class=_Parser
    )
    with_config(config_commands.add_parser("show", help="print the resolved config"))
    gen = commands.add_parser("generate", help="sample text from a run or checkpoint")
    gen.add_argument("--run", required=True, help="run name, run folder or checkpoint folder")
    gen.add_argument("--prompt", default="")
    gen.add_argument("--tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output-dir", default="runs")
    return parser


def run(argv: list[str]) -> int:
    from raytrain_lm.config import load_config, to_yaml

    argv, short_overrides = _split_overrides(argv)
    args = _parser().parse_args(argv)
    if args.command == "generate":
        from raytrain_lm.generate import resolve_checkpoint, sample

        checkpoint = resolve_checkpoint(args.run, args.output_dir)
        print(sample(checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
        return 0

    cfg = load_config(args.config, [*args.set, *short_overrides])
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    if args.command == "prepare":
        from raytrain_lm.data.prepare import prepare

        prepared = prepare(cfg.data)
        m = prepared.manifest
        state = "prepared" if prepared.created else "already prepared (nothing to do)"
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
    return 0


def _train_tokenizer(cfg, out: str, sample_bytes: int) -> int:
    from pathlib import Path

    from raytrain_lm.data.prepare import train_bpe
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
    except UserError as exc:
        print(f"raytrain-lm: error: {exc}", file=sys.stderr)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("raytrain-lm: interrupted; run the same command again to resume", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
