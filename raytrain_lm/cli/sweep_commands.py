"""`sweep SWEEP.yaml` (run or resume a sweep) and `sweep report NAME`."""

from __future__ import annotations

from raytrain_lm.cli.exit_codes import EXIT_INTERRUPTED
from raytrain_lm.errors import UserError


def run_sweep_command(args, short_overrides: list[str]) -> int:
    if args.target == "report":
        return _report(args, short_overrides)
    if args.name:
        raise UserError(f"unexpected argument '{args.name}' after the sweep file")
    from raytrain_lm.api import sweep

    summary = sweep(args.target, [*args.set, *short_overrides])
    best = next((r for r in summary["ranked"] if r["val_loss"] is not None), None)
    if best is not None:
        print(f"best: {best['run_name']} val_loss {best['val_loss']:.4f} ({best['params']})")
    print(f"report: {summary['report']}")
    return EXIT_INTERRUPTED if summary["interrupted"] else 0


def _report(args, short_overrides: list[str]) -> int:
    if not args.name:
        raise UserError("usage: raytrain-lm sweep report NAME")
    if args.set or short_overrides:
        raise UserError("`sweep report` takes no config overrides")
    from raytrain_lm.api import sweep_report

    result = sweep_report(args.name, args.output_dir, args.out)
    print(result["table"])
    print(f"report: {result['png']}")
    return 0
