"""The `raytrain-lm` program: `run` sends a command line to its command; `main` turns what
escapes into an exit status (user errors: one line on stderr, status 2, no traceback)."""

from __future__ import annotations

import io
import sys

from raytrain_lm.cli.cluster_commands import CLUSTER_COMMANDS, run_cluster_command
from raytrain_lm.cli.config_commands import run_config_command
from raytrain_lm.cli.exit_codes import EXIT_INTERRUPTED, EXIT_USER_ERROR
from raytrain_lm.cli.parser import build_parser, split_overrides
from raytrain_lm.cli.sweep_commands import run_sweep_command
from raytrain_lm.cli.tracking_commands import TRACKING_COMMANDS, run_tracking_command
from raytrain_lm.cli.trained_run_commands import TRAINED_RUN_COMMANDS, run_trained_run_command
from raytrain_lm.errors import InterruptedBeforeStart, UserError, find_user_error


def run(argv: list[str]) -> int:
    argv, short_overrides = split_overrides(argv)
    args = build_parser().parse_args(argv)
    if args.command in CLUSTER_COMMANDS:
        return run_cluster_command(args, short_overrides)
    if args.command in TRACKING_COMMANDS:
        if short_overrides:
            raise UserError(f"`tracking` takes no config overrides: {short_overrides[0]}")
        return run_tracking_command(args)
    if args.command == "sweep":
        return run_sweep_command(args, short_overrides)
    if args.command in TRAINED_RUN_COMMANDS:
        return run_trained_run_command(args)
    return run_config_command(args, short_overrides)


def _quiet_logs() -> None:
    """The CLI speaks for itself: Ray's INFO chatter stays in Ray's log files."""
    import logging
    import os

    os.environ.setdefault("RAY_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    for name in ("ray.data", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    # Line by line into a file or a pipe too (`> train.log`, `| tee`, a Ray job's log that
    # `ray job logs --follow` reads): block-buffered, the progress lines came at exit.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
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
