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
  dashboard figures are lost, never the pipeline's data;
- Ray Train's placement-group cleaner (a detached actor that frees a run's placement group if
  its controller dies): its note when it does so (a Tune trial stopped, a Ctrl-C), and, where
  it cannot find its own cluster's API server (a Ray that a notebook started itself with
  `ray.init`, beside another Ray on the machine; ours name it: runtime.naming_api_server),
  its "Found multiple active Ray instances", its thread's traceback when that Ray does not
  answer, the controller's 7-line "Failed to register placement group with cleaner" once the
  cleaner has given up, or the controller's traceback when the cleaner, stuck asking the
  other Ray, does not stop in time. The run's own end frees its placement group either way,
  and a Ray the notebook started goes with the notebook;
- "Token authentication is enabled for this Ray cluster" at every new local Ray (token auth
  stays on: the notice alone goes; its warning that auth is disabled stays);
- Tune's progress tables, its experiment box and its TensorBoard hint (TensorBoard is not
  installed), its note of where it wrote its state, and a trial's "Checkpoint successfully
  created" at every report: the sweep prints a line per trial start and end itself
  (sweeps/progress.py).

Each is stopped where it is made, by the narrowest means that Ray leaves: a documented
setting where there is one (`RAY_COLOR_PREFIX`, `DataContext.print_on_execution_start`, Tune's
`verbose`), else a logging level or filter on the one Ray logger or message concerned. Nothing
here can hide an error: the filters drop only the messages named above, and an unknown one
passes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator

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
# Ray Train's placement-group cleaner (train/v2/_internal/.../placement_group_cleaner.py), and
# what its controller logs when the cleaner has exited (callbacks/placement_group_callback.py):
# a first line, the error's own lines, a last line with this end.
CLEANER = "PlacementGroupCleaner"
CLEANER_NOTES = re.compile(
    r"Detected that the Ray Train controller actor \([0-9a-f]+\) is dead\. Cleaning up placement "
    r"group|Found multiple active Ray instances: .* Connecting to latest cluster at"
    r"|Monitor thread did not exit within [\d.]+ seconds"
    r"|Failed to query Ray Train Controller actor state\. State API may be temporarily"
)
CLEANER_GONE = "Failed to register placement group with cleaner: "
CLEANER_GONE_END = "Placement group may not be cleaned up if controller dies ungracefully."
CLEANER_GONE_LINES = 12  # at most, or it is not that message: printed whole
# The controller's traceback when the cleaner did not stop in time, or had died already.
CLEANER_UNSTOPPED = re.compile(r"^Failed to stop PlacementGroupCleaner gracefully\.$")
CLEANER_UNSTOPPED_WHY = re.compile(
    r"^ray\.exceptions\.(GetTimeoutError|RayActorError|ActorDiedError)"
)
# The cleaner's own thread dying as it looks for its cluster where it cannot find it.
CLEANER_LOST = re.compile(r"^Exception in thread PlacementGroupCleanerMonitor:$")
CLEANER_LOST_WHY = re.compile(
    r"^(ray\.exceptions\.RpcError|ConnectionError"
    r"|ray\.util\.state\.exception\.RayStateApiException)"
)
# Tracebacks printed under a first line (the first pattern), dropped whole when their
# exception, the last line, is the harmless one (the second); any other is printed whole.
HARMLESS_TRACEBACKS = (
    (STATS_UPDATE_FAILED, STATS_KEY_UNKNOWN),
    (CLEANER_UNSTOPPED, CLEANER_UNSTOPPED_WHY),
    (CLEANER_LOST, CLEANER_LOST_WHY),
)
# ray/_private/authentication/authentication_token_setup.py
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_ON = "Token authentication is enabled for this Ray cluster."
TUNE_NEW_OUTPUT = "RAY_AIR_NEW_OUTPUT"  # ray/tune/experimental/output.py


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
    quiet_token_auth_notice()  # before the notebook's own ray.init
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
    harmless = _HarmlessLines()

    def handle(data: dict) -> None:
        lines = data.get("lines") or []
        kept = harmless.kept(data.get("pid"), data.get("actor_name"), lines)
        if kept or not lines:
            handler({**data, "lines": kept})

    handle.drops_harmless_lines = True
    return handle


class _HarmlessLines:
    """The lines of a process's output that are not the harmless messages named above.
    Several of those span lines, which may come in several batches: what is read of one so
    far is kept per process until its end shows whether it goes or is printed whole."""

    def __init__(self):
        self.aborted: set = set()  # processes whose actor-creation abort is being printed
        self.held: dict = {}  # per process, a traceback read so far and its harmless last line
        self.unregistered: dict = {}  # per process, the lines of a controller's cleaner error

    def kept(self, pid, actor_name: str | None, lines: list[str]) -> list[str]:
        return [kept for line in lines for kept in self._after(pid, actor_name, line)]

    def _after(self, pid, actor_name: str | None, line: str) -> list[str]:
        """What `line`, and what it ends of a message held so far, leave to print."""
        plain = ANSI.sub("", line)
        if pid in self.unregistered:
            return self._cleaner_gone_goes_on(pid, line)
        if pid in self.held:
            if line.startswith((" ", "\t", "Traceback")):
                self.held[pid][1].append(line)
                return []
            harmless, error = self.held.pop(pid)
            if harmless.match(plain):
                return []  # the whole traceback, its exception the harmless one
            # Any other error is printed whole.
            return [*error, *self._alone(pid, actor_name, line, plain)]
        return self._alone(pid, actor_name, line, plain)

    def _cleaner_gone_goes_on(self, pid, line: str) -> list[str]:
        self.unregistered[pid].append(line)
        if CLEANER_GONE_END in line:
            del self.unregistered[pid]  # the whole message, dropped
        elif len(self.unregistered[pid]) >= CLEANER_GONE_LINES:
            return self.unregistered.pop(pid)  # longer than that message: another, printed
        return []

    def _alone(self, pid, actor_name: str | None, line: str, plain: str) -> list[str]:
        """What a line that continues no held message leaves to print."""
        if self._opens_long_message(pid, line, plain):
            return []
        if actor_name == CLEANER and CLEANER_NOTES.search(plain):
            return []
        if ACTOR_CREATION_ABORTED.search(line):
            self.aborted.add(pid)
            return []
        if pid in self.aborted and _STACK_FRAME.search(line):
            return []  # that abort's stack trace
        if not line.strip():
            return []  # a blank line from a worker says nothing, prefixed with its name
        if HARMLESS_ACTOR_ARGS.search(line) or ACTOR_ALREADY_GONE.search(line):
            return []
        self.aborted.discard(pid)
        return [line]

    def _opens_long_message(self, pid, line: str, plain: str) -> bool:
        """Whether `line` opens a harmless message of several lines, held from here until its
        end shows whether it goes (a cleaner error that is whole in this line goes at once)."""
        traceback_of = next((h for first, h in HARMLESS_TRACEBACKS if first.search(plain)), None)
        if traceback_of is not None:
            self.held[pid] = (traceback_of, [line])
            return True
        if CLEANER_GONE in line:
            if CLEANER_GONE_END not in line:
                self.unregistered[pid] = [line]
            return True
        return False


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


class _DropTokenAuthOn(logging.Filter):
    """Ray's notice, at every new local Ray, that token authentication is on (as it should be);
    its warning that authentication is off passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_AUTH_ON)


def quiet_token_auth_notice() -> None:
    """Drops Ray's "Token authentication is enabled" notice in this process. Idempotent."""
    _add_filter_once(logging.getLogger(TOKEN_AUTH_LOGGER), _DropTokenAuthOn())


def quiet_trial_reports() -> None:
    """In a Tune trial's actor: Tune's function trainable logs each report's checkpoint
    ("Checkpoint successfully created at: ...") at INFO; the trial's progress says as much."""
    logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)


@contextlib.contextmanager
def quiet_tune() -> Iterator[None]:
    """While inside, Tune's output follows its `verbose` setting: Tune's newer output engine,
    its default in a terminal, prints its experiment box, results folder and TensorBoard hint
    whatever `verbose` says; its other engine (RAY_AIR_NEW_OUTPUT=0, what it uses in a
    notebook) prints nothing at verbose=0. Read when Tune starts, so set only meanwhile."""
    before = os.environ.get(TUNE_NEW_OUTPUT)
    os.environ[TUNE_NEW_OUTPUT] = "0"
    # tune.run logs at INFO where it wrote its state ("Wrote the latest version of all result
    # files ..."), whatever `verbose` says.
    tune_log = logging.getLogger("ray.tune.tune")
    level = tune_log.level
    tune_log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        tune_log.setLevel(level)
        if before is None:
            os.environ.pop(TUNE_NEW_OUTPUT, None)
        else:
            os.environ[TUNE_NEW_OUTPUT] = before


def _add_filter_once(logger: logging.Logger, new: logging.Filter) -> None:
    if not any(type(f) is type(new) for f in logger.filters):
        logger.addFilter(new)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by something without, or closed
        return False
