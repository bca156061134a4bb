"""Commands that read a trained run back: `generate`, `export`, `eval` (each also given a
registered model, `models:/NAME@ALIAS`) and `promote`."""

from __future__ import annotations

import json

TRAINED_RUN_COMMANDS = ("generate", "export", "eval", "promote")


def run_trained_run_command(args) -> int:
    if args.command == "promote":
        return _promote(args)
    from raytrain_lm.registry import checkpoint_of

    args.run = checkpoint_of(args.run)
    if args.command == "export":
        return _export(args)
    if args.command == "eval":
        return _evaluate(args)
    return _generate(args)


def _promote(args) -> int:
    from raytrain_lm.registry import promote

    done = promote(args.run, args.name, args.alias, args.output_dir, args.step, args.best)
    print(
        f"[raytrain-lm] {done.name} version {done.version} is step {done.step} of run "
        f"'{args.run}' ({done.checkpoint}, kept from pruning); {done.name}@{done.alias} "
        f"points at it: models:/{done.name}@{done.alias}"
    )
    return 0


def _export(args) -> int:
    from raytrain_lm.huggingface import export

    out = export(args.run, args.out, args.output_dir, args.format)
    print(f"[raytrain-lm] exported {args.run} to {out} (load with transformers' "
          f"AutoModelForCausalLM.from_pretrained)")  # fmt: skip
    return 0


def _evaluate(args) -> int:
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


def _generate(args) -> int:
    from raytrain_lm.generate import resolve_checkpoint, sample

    checkpoint = resolve_checkpoint(args.run, args.output_dir)
    print(sample(checkpoint, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    return 0
