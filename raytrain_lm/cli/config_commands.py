"""Commands that take a run config and its overrides: `plan`, `config show`, `prepare`,
`tokenizer train` and `train`."""

from __future__ import annotations

import json

from raytrain_lm.cli.exit_codes import EXIT_INTERRUPTED
from raytrain_lm.errors import UserError


def run_config_command(args, short_overrides: list[str]) -> int:
    from raytrain_lm.config import load_config

    overrides = [*args.set, *short_overrides]
    if args.command == "plan":
        return _plan(args, load_config(args.config, overrides))
    # Every path as the run will use it: what `config show` prints, what `prepare` fingerprints
    # (a tokenizer path spelled differently would otherwise prepare the same data twice).
    cfg = load_config(args.config, overrides).resolved()
    if args.command == "config":
        from raytrain_lm.config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    if args.command == "prepare":
        return _prepare(cfg)
    if args.command == "tokenizer":
        return _train_tokenizer(cfg, args.out, args.sample_bytes)
    return _train(cfg)


def _plan(args, cfg) -> int:
    from raytrain_lm.costs import plan
    from raytrain_lm.costs.report import render

    result = plan(cfg, args.tokens, args.deadline, args.budget, args.from_run, args.catalog)
    print(json.dumps(result, indent=1) if args.json else render(result, args.rows))
    return 0


def _prepare(cfg) -> int:
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


def _train(cfg) -> int:
    from raytrain_lm.api import train

    summary = train(cfg)
    print("summary: " + json.dumps(summary))
    if summary.get("mlflow_run_id"):
        from raytrain_lm.tracking.ui import where_to_look

        print(where_to_look(cfg.tracking.uri, summary["mlflow_run_id"]))
    return EXIT_INTERRUPTED if summary["stopped"] else 0
