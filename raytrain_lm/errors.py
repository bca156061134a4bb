"""User-facing errors: anything the user can fix raises `UserError`; the CLI prints it on one line.

A `UserError` raised inside a Ray task, actor, Train worker or Tune trial reaches the driver
wrapped: as a `RayTaskError` whose text is the task header plus a traceback, inside Ray
Data's `UserCodeException`, in Ray Train's `WorkerGroupError` (one per failed rank), or as
the cause of a Tune error. `find_user_error` digs the user's own error out of any of these,
so every entry point can show the user one line however deep the error was raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class UserError(Exception):
    """A problem with the user's input (config, data, paths) rather than a bug in raytrain-lm."""


def _inner_errors(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions `exc` wraps, the most specific first."""
    cause = getattr(exc, "cause", None)  # RayTaskError (and its dual-class subclasses)
    if isinstance(cause, BaseException):
        yield cause
    failures = getattr(exc, "worker_failures", None)  # Ray Train V2's WorkerGroupError
    if isinstance(failures, dict):
        yield from (e for _, e in sorted(failures.items()) if isinstance(e, BaseException))
    if exc.__cause__ is not None:
        yield exc.__cause__
    if exc.__context__ is not None and not exc.__suppress_context__:
        yield exc.__context__


def find_user_error(exc: BaseException) -> UserError | None:
    """The `UserError` at the root of `exc`, as the user raised it (its own message, without
    a Ray task header or traceback), or None when `exc` is not one of ours."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        inner = list(_inner_errors(current))
        # A Ray wrapper that also derives from UserError carries the task's text: skip it.
        if isinstance(current, UserError) and not hasattr(current, "cause"):
            return current
        pending.extend(inner)
    return None


@contextlib.contextmanager
def surface_user_errors() -> Iterator[None]:
    """Re-raises a `UserError` buried in whatever Ray raised as that `UserError` alone."""
    try:
        yield
    except Exception as exc:
        found = find_user_error(exc)
        if found is None or found is exc:
            raise
        raise found from None


class InterruptedBeforeStart(KeyboardInterrupt):
    """Ctrl-C while a run waited to start (for its tracking store): nothing of it started or
    was written. Its text says so; the CLI prints it and exits as after any Ctrl-C."""
