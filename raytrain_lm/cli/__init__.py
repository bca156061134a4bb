"""The `raytrain-lm` command line (`raytrain_lm.cli:main`, or `python -m raytrain_lm.cli`).

`parser` reads the command line (every user error in it is a `UserError`); the commands, by
what they work on: `config_commands` (a run config: plan, config show, prepare, tokenizer
train, train), `trained_run_commands` (generate, export, eval), `sweep_commands`,
`cluster_commands` (Ray jobs, the local cluster); `entry` sends a command line to its
command and turns errors into exit statuses (`exit_codes`).
"""

from raytrain_lm.cli.entry import main, run

__all__ = ["main", "run"]
