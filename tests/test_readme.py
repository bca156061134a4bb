"""The README, read and run as a newcomer does: in order, in the shell it describes.

It opens with the two commands, `make demo` and `make test`. Every command after `make demo`
must run as written in the checkout once `.venv` is activated as the README says: it names a
target of the Makefile, a program `make` puts in .venv/bin, or the activation itself; a
`raytrain-lm` command parses with the CLI's own parser and its config, overrides and inputs
load; `mlflow ui` parses with MLflow's. The cheap ones then run for real in a folder laid out
as a checkout after `make demo`, whose `runs/demo` and `mlflow.db` are the session's shared
trained run and store: `config show`, `generate`, and the store the README's `mlflow ui` opens
holds the run, in an experiment that opens in MLflow's training view at the README's link.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_lm import cli
from raytrain_lm.cli.parser import build_parser, split_overrides
from raytrain_lm.config import load_config
from raytrain_lm.config.tracking import TrackingConfig
from raytrain_lm.tracking.mlflow_tracker import MLflowTracker
from raytrain_lm.tracking.ui import (
    KIND_TAG,
    TRAINING_KIND,
    TRAINING_VIEW_TAG,
    experiment_link,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent  # where `make` installs the programs (.venv/bin)
ACTIVATE = ["source", ".venv/bin/activate"]
# Config-taking commands whose config and overrides load without Ray (load_config checks every
# key and value); `submit` validates the same way before it uploads anything.
LOADS_CONFIG = {"train", "config", "prepare", "plan", "submit"}


def readme_commands() -> list[tuple[int, list[str]]]:
    """Every command of the README's bash blocks in order, with its line: a line split as the
    shell splits it (comments dropped), `a && b` as two commands."""
    commands, in_block = [], False
    for number, line in enumerate(README.read_text().splitlines(), start=1):
        if line.startswith("```"):
            in_block = line == "```bash" if not in_block else False
            continue
        if not in_block:
            continue
        words = shlex.split(line, comments=True)
        while words:
            command, _, rest = _split_at(words, "&&")
            commands.append((number, command))
            words = rest
    return commands


def _split_at(words: list[str], separator: str) -> tuple[list[str], str, list[str]]:
    if separator in words:
        at = words.index(separator)
        return words[:at], separator, words[at + 1 :]
    return words, "", []


def after_make_demo() -> list[tuple[int, list[str]]]:
    commands = readme_commands()
    first = next(i for i, (_, words) in enumerate(commands) if words == ["make", "demo"])
    return [c for c in commands[first + 1 :] if c[1] != ["make", "test"]]


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([a-z][\w-]*):", text, re.M)}


def test_the_readme_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# "), "the README starts with its title"
    opening = lines.index("```bash")
    assert opening <= 3, f"the first code block starts at line {opening + 1}, not at the top"
    closing = lines.index("```", opening + 1)
    block = [shlex.split(line, comments=True) for line in lines[opening + 1 : closing]]
    assert block == [["make", "demo"], ["make", "test"]], block


def test_the_readme_is_a_newcomers_page_whose_links_work():
    text = README.read_text()
    assert len(text.splitlines()) <= 100, "the README grew back: reference belongs in docs/"
    for moved in ("| path | what |", "minutes (2026-"):
        assert moved not in text, f"{moved!r} belongs in docs/layout.md or docs/development.md"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to no doc"
    for link in links:
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
    for doc in ("docs/layout.md", "docs/development.md", "docs/usage.md"):
        assert doc in links, f"the README does not link {doc}"


def test_every_command_after_make_demo_runs_as_written_in_the_activated_venv():
    commands = after_make_demo()
    assert commands, "the README gives no command after `make demo`"
    activated_at = next((n for n, words in commands if words == ACTIVATE), None)
    assert activated_at is not None, "the README never activates .venv as its commands need"
    targets = make_targets()
    for line, words in commands:
        where = f"README line {line}: {shlex.join(words)}"
        program = words[0]
        if program == "make":
            assert words[1] in targets, f"{where}: the Makefile has no target {words[1]}"
        elif words == ACTIVATE:
            continue  # `make` creates it: .venv/bin/activate is the venv's own
        else:
            assert (VENV_BIN / program).is_file(), f"{where}: `make` installs no {program}"
            assert line > activated_at, f"{where}: runs before the README activates .venv"
            if program == "raytrain-lm":
                _check_raytrain_lm(words[1:], where)
            elif program == "mlflow":
                _check_mlflow(words[1:], where)
            else:
                pytest.fail(f"{where}: no check for {program}; add one")


def _check_raytrain_lm(argv: list[str], where: str) -> None:
    from raytrain_lm.data.sources import expand_sources
    from raytrain_lm.errors import UserError

    rest, short = split_overrides(argv)
    try:
        args = build_parser().parse_args(rest)
    except UserError as refused:
        pytest.fail(f"{where}: the CLI refuses it: {refused}")
    config = getattr(args, "config", None)
    if args.command == "sweep":
        config = None
        assert (ROOT / args.target).is_file(), f"{where}: no sweep file {args.target}"
    if config is not None:
        assert (ROOT / config).is_file(), f"{where}: no config file {config}"
    if args.command in LOADS_CONFIG:
        try:
            cfg = load_config(str(ROOT / config) if config else None, [*args.set, *short])
        except UserError as refused:
            pytest.fail(f"{where}: its config does not load: {refused}")
        # Local inputs only: a bucket or a builtin corpus is no file of the checkout.
        local = [str(ROOT / s) for s in cfg.data.sources if ":" not in s]
        try:
            expand_sources(local)
        except UserError as refused:
            pytest.fail(f"{where}: its data sources name no input: {refused}")


def _check_mlflow(argv: list[str], where: str) -> None:
    import click
    from mlflow.cli import cli as mlflow_cli

    command = mlflow_cli.get_command(click.Context(mlflow_cli), argv[0])
    assert command is not None, f"{where}: MLflow has no command {argv[0]}"
    try:
        command.make_context(argv[0], argv[1:])
    except click.UsageError as refused:
        pytest.fail(f"{where}: MLflow refuses it: {refused.format_message()}")


def readme_ui_store() -> str:
    ((_, words),) = [(n, w) for n, w in after_make_demo() if w[:2] == ["mlflow", "ui"]]
    return words[words.index("--backend-store-uri") + 1]


def readme_link() -> str:
    (link,) = re.findall(r"<(http://127\.0\.0\.1:5000/[^>]+)>", README.read_text())
    return link


def test_a_fresh_clones_first_run_is_at_the_readmes_link(tmp_path):
    """The store in a fresh clone: the first experiment a run makes is 1, and its link is the
    one the README gives."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker.start(uri, "raytrain-lm", "demo", None, wait_s=0)
    tracker.finish()
    experiment = tracker.client.get_run(tracker.run_id).info.experiment_id
    assert readme_link() == experiment_link(experiment)


@pytest.fixture
def checkout_after_demo(tmp_path, learned_run, shared_dirs, monkeypatch) -> Path:
    """A folder laid out as the checkout after `make demo`, made current: `runs/demo` is the
    session's shared trained run, `mlflow.db` the store it logged to, `experiments/` the
    repository's. Links only: nothing in them is written."""
    checkout = tmp_path / "checkout"
    (checkout / "runs").mkdir(parents=True)
    (checkout / "runs" / "demo").symlink_to(learned_run["output_dir"] / "learns")
    (checkout / "mlflow.db").symlink_to(shared_dirs["mlflow"])
    (checkout / "experiments").symlink_to(ROOT / "experiments")
    monkeypatch.chdir(checkout)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return checkout


def test_the_readmes_cheap_commands_work_on_a_finished_run(checkout_after_demo, capsys):
    ran = set()
    for line, words in after_make_demo():
        if words[0] != "raytrain-lm" or words[1] not in ("config", "generate"):
            continue
        assert cli.run(words[1:]) == 0, f"README line {line}"
        printed = capsys.readouterr().out
        if words[1] == "config":
            shown = yaml.safe_load(printed)
            assert shown["output_dir"] == str(checkout_after_demo / "runs")
            assert shown["tracking"]["uri"] == f"sqlite:///{checkout_after_demo / 'mlflow.db'}"
        else:
            prompt = words[words.index("--prompt") + 1]
            assert printed.startswith(prompt) and len(printed) > len(prompt) + 100, printed
        ran.add(words[1])
    assert ran == {"config", "generate"}, (
        f"the README no longer shows {ran ^ {'config', 'generate'}}"
    )


def test_the_readmes_mlflow_ui_shows_the_runs_store_in_the_training_view(
    checkout_after_demo, learned_run
):
    from mlflow.tracking import MlflowClient

    from raytrain_lm.config.tracking import _absolute_store_uri

    shown = _absolute_store_uri(readme_ui_store(), checkout_after_demo)
    logged_to = TrackingConfig().store_uri(checkout_after_demo)  # what `train` here logs to
    assert shown == logged_to, "`mlflow ui` as the README starts it opens another store"
    client = MlflowClient(tracking_uri=shown)
    run = client.get_run(learned_run["summary"]["mlflow_run_id"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags[KIND_TAG] == TRAINING_KIND
    view = json.loads(experiment.tags[TRAINING_VIEW_TAG])
    first_chart = json.loads(view["state"])["compareRunCharts"][0]
    assert first_chart["selectedMetricKeys"] == ["train/loss", "val/loss"]
    assert {"train/loss", "val/loss"} <= set(run.data.metrics)
    view_asked = readme_link().partition("/runs?")[2]
    assert view_asked == experiment_link(run.info.experiment_id).partition("/runs?")[2]
