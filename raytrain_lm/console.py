"""What Ray prints around our work, kept to what a user needs, in a notebook and a terminal.

Ray 2.60 adds to a run's own lines, each time, none of it about the run:

- in a Jupyter kernel without ipywidgets: tqdm's "IProgress not found" warning at `import ray`
  (ray.experimental.tqdm_ray imports tqdm.auto, which we never draw with) and Ray's "Missing
  packages: ['ipywidgets']" at each import of ray, ray.data and ray.train (about HTML reprs);
- ANSI colours where the output is no terminal: around the dashboard URL that `ray.init` logs,
  around the `(RayTrainWorker pid=...)` prefix of each line a Ray process prints and, in a
  notebook that imported Ray itself, around the "[repeated 2x across cluster]" of its log
  deduplication (which runs of ours turn off);
- an E-level core_worker line from each process that creates an actor with restarts and
  constructor arguments in the object store (ray#53727): Ray Train's PreemptionWatcher and
  every Ray Data map actor are made so, and keep those arguments alive for the actor's life;
- Ray Data's execution plan, its start and finish lines and a "Progress bars disabled" hint
  for every pipeline of ours (`pipeline.ordered_dataset`), in the driver and in each worker;
- the traceback a worker prints, at every metrics update of one of our pipelines, when Ray
  Data's stats actor does not know that pipeline (a KeyError in `_StatsActor.update_*`: seen
  once in CI, from a stats actor made again after the pipeline started): only the actor's
  dashboard figures are lost, never the pipeline's data.

Each is stopped where it is made, by the narrowest means that Ray leaves: a documented
setting where there is one (`RAY_COLOR_PREFIX`, `DataContext.print_on_execution_start`), else
a logging level or filter on the one Ray logger or message concerned. Nothing here can hide an
error: the filters drop only the messages named above, and an unknown one passes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings

# Ray Data pipelines of ours are named with this prefix (`pipeline.ordered_dataset`): Ray Data
# puts the name in its dataset ids, hence in its log lines and its dashboard.
DATASET_NAME_PREFIX = "raytrain_lm"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The one core_worker message dropped from worker output (ray#53727), word for word up to the
# class name and ID: every other line of a Ray process, E-level or not, is printed.
HARMLESS_ACTOR_ARGS = re.compile(
    r"core_worker\.cc:\d+: Actor with class name: '[^']*' and ID: '[0-9a-f]+' has constructor "
    r"arguments in the object store and max_restarts > 0\."
)
# The GCS failing to kill an actor whose worker is gone already (a trial's actors torn down as
# its run ends, racing their own exit): the actor is dead either way.
ACTOR_ALREADY_GONE = re.compile(
    r"gcs_actor_scheduler\.cc:\d+: Failed to kill actor [0-9a-f]+, return status: Invalid: "
    r"KillActor RPC failed"
)
# A worker process that Ray shuts down while it is still creating an actor (a trial's or a
# data stream's actors torn down as a run ends) finds its raylet connection closed and aborts
# on a CHECK, printing a C++ stack trace that calls itself a Ray bug and blames a raylet
# crash. Its run has finished by then; the lines of that one abort are dropped, nothing else.
ACTOR_CREATION_ABORTED = re.compile(
    r"Check failed: raylet_ipc_client_->ActorCreationTaskDone\(\) Status not OK: IOError: "
    r"Broken pipe"
)
# The first and last lines of a Ray Data stats actor's KeyError about one of our pipelines, as
# the worker that asked for the update prints it (between them, indented traceback lines).
STATS_UPDATE_FAILED = re.compile(r"Unhandled error .*ray::_StatsActor\.update_\w+_metrics\(\)")
STATS_KEY_UNKNOWN = re.compile(rf"^KeyError: '{DATASET_NAME_PREFIX}_\w+'$")
_STACK_FRAME = re.compile(
    r"^\s*$|\*\*\* StackTrace Information \*\*\*|\(\+0x[0-9a-f]+\)|\) \[0x[0-9a-f]+\]"
)
_PRINT_LOGS = "ray_print_logs"  # the driver's handler of worker output (ray._private.worker)


def quiet_notebook() -> None:
    """Settings for a Jupyter kernel, made when `raytrain_lm` is imported there (see
    `raytrain_lm/__init__.py`): before the notebook's `import ray`, which prints the first
    hints. Idempotent."""
    # tqdm.auto warns once, when first imported, that a notebook bar needs ipywidgets, then
    # falls back to the text bar. Imported here first, warning caught, Ray's import of it
    # finds it loaded. Our own bars are text bars (`from tqdm import tqdm`): they need none.
    with warnings.catch_warnings(), contextlib.suppress(ImportError):
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401

    # Ray's log deduplication, read at `import ray`, marks the lines it merges with colour
    # codes and advice on turning it off: runs of ours turn it off (launch.default_ray_env),
    # too late for the Ray a notebook imports itself. The user's setting wins.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # ray.widgets.util logs only whether ipywidgets is there for Ray's HTML reprs (INFO);
    # without them Ray shows the plain repr, which is all we show.
    widgets = logging.getLogger("ray.widgets.util")
    if widgets.level == logging.NOTSET:
        widgets.setLevel(logging.WARNING)
    plain_when_not_a_terminal()


class _StripAnsi(logging.Filter):
    """Removes ANSI colour codes from a record (`ray.init` colours the dashboard URL with
    colorama's codes whatever its output: Ray has no setting for it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_terminal(sys.stderr):
            message = record.getMessage()
            if "\x1b[" in message:
                record.msg, record.args = ANSI.sub("", message), None
        return True


def plain_when_not_a_terminal() -> None:
    """No ANSI colour codes in Ray's driver output when it goes to no terminal (a notebook, a
    file, a pipe). A terminal keeps its colours. Idempotent; the user's settings win."""
    if _is_terminal(sys.stdout) and _is_terminal(sys.stderr):
        return
    # Read by the driver as it prints each line from a Ray process (documented: "Configuring
    # logging"), so it may be set after ray.init.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    _add_filter_once(logging.getLogger("ray._private.worker"), _StripAnsi())


def quiet_worker_output() -> None:
    """Drops the ray#53727 core_worker line from the worker output that the driver prints.

    Ray's C++ core worker writes it to the process's stderr, from where Ray forwards it to the
    driver like any line a worker prints. Ray 2.60 has no setting for one message
    (RAY_BACKEND_LOG_LEVEL would silence every C++ error), so the driver's printing handler,
    registered by `ray.init` under the name `ray_print_logs` in Ray's internal dispatcher, is
    wrapped to drop that message; if Ray renames either, worker output is left as it is.
    Call after ray.init, in the driver; idempotent."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    with getattr(dispatcher, "_lock", contextlib.nullcontext()):
        dispatcher.handlers = [
            (name, _dropping_harmless(handler) if name == _PRINT_LOGS else handler)
            for name, handler in getattr(dispatcher, "handlers", [])
        ]


def _dropping_harmless(handler):
    if getattr(handler, "drops_harmless_lines", False):
        return handler
    aborted: set = set()  # processes whose actor-creation abort is being printed
    held: dict = {}  # per process, the lines of a stats actor's error read so far

    def handle(data: dict) -> None:
        lines, kept = data.get("lines") or [], []
        pid = data.get("pid")
        for line in lines:
            if pid in held:
                if line.startswith((" ", "Traceback")):
                    held[pid].append(line)
                    continue
                error = held.pop(pid)
                if STATS_KEY_UNKNOWN.match(ANSI.sub("", line)):
                    continue  # the whole traceback: a KeyError about one of our pipelines
                kept.extend(error)  # any other error is printed whole
            if STATS_UPDATE_FAILED.search(ANSI.sub("", line)):
                held[pid] = [line]
            elif ACTOR_CREATION_ABORTED.search(line):
                aborted.add(pid)
            elif pid in aborted and _STACK_FRAME.search(line):
                continue  # that abort's stack trace
            elif not line.strip():
                continue  # a blank line from a worker says nothing, prefixed with its name
            elif not (HARMLESS_ACTOR_ARGS.search(line) or ACTOR_ALREADY_GONE.search(line)):
                aborted.discard(pid)
                kept.append(line)
        if kept or not lines:
            handler({**data, "lines": kept})

    handle.drops_harmless_lines = True
    return handle


class _DropRayDataChatter(logging.Filter):
    """Ray Data's "Progress bars disabled" hint (we disable them: `prepare` draws its own bar,
    a worker's reads need none) and the "execution finished" line of our own pipelines. A
    failed one raises to its caller, and its "execution failed" line passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Progress bars disabled."):
            return False
        ours = f"Dataset {DATASET_NAME_PREFIX}" in message
        return not (ours and record.levelno < logging.WARNING and "execution finished" in message)


def quiet_ray_data() -> None:
    """Filters, in this process, the Ray Data lines `_DropRayDataChatter` names (the loggers'
    level stays: their other messages pass). Idempotent."""
    for name in ("ray.data._internal.progress", "ray.data._internal.execution.streaming_executor"):
        _add_filter_once(logging.getLogger(name), _DropRayDataChatter())


def _add_filter_once(logger: logging.Logger, new: logging.Filter) -> None:
    if not any(type(f) is type(new) for f in logger.filters):
        logger.addFilter(new)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by something without, or closed
        return False
