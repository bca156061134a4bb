"""What the driver prints of Ray's worker output (raytrain_lm/console.py): the two known
harmless Ray messages (and blank lines) are dropped, every other line passes, errors included."""

from __future__ import annotations

from raytrain_lm.console import _dropping_harmless

ACTOR_ARGS = (
    "[2026-12-04 09:20:49,696 E 5 5] core_worker.cc:812: Actor with class name: "
    "'PreemptionWatcher' and ID: 'ab12' has constructor arguments in the object store and "
    "max_restarts > 0. If the arguments are spilled to disk or not available ..."
)
ABORT = [
    "[2026-12-04 09:20:49,696 C 21802 21802] core_worker.cc:3345:  An unexpected system state "
    "has occurred. You have likely discovered a bug in Ray. Check failed: "
    "raylet_ipc_client_->ActorCreationTaskDone() Status not OK: IOError: Broken pipe "
    "Unexpected error in IPC to the Raylet; the Raylet has most likely crashed.",
    "*** StackTrace Information ***",
    "/venv/ray/_raylet.so(+0x1812b9a) [0x7f9037012b9a] ray::operator<<()",
]
GONE = (
    "[2026-12-04 14:10:00,294 E 12845 12845] (gcs_server) gcs_actor_scheduler.cc:538: Failed to "
    "kill actor d47443a60e08, return status: Invalid: KillActor RPC failed for actor d47443a60e08"
)
REAL_ERROR = "[2026-12-04 09:20:50,001 E 9 9] core_worker.cc:100: Failed to connect: timeout"


def test_harmless_ray_lines_are_dropped_and_errors_pass():
    printed: list[dict] = []
    handle = _dropping_harmless(printed.append)
    handle({"pid": 5, "lines": [ACTOR_ARGS, "step 10 done"]})
    handle({"pid": 21802, "lines": ABORT[:2]})  # a trace may arrive in several batches
    handle({"pid": 21802, "lines": [*ABORT[2:], "", "(+0x1) [0x2] more frames", "a later line"]})
    handle({"pid": 9, "lines": [REAL_ERROR, "/lib/libc.so.6(+0x2724a) [0x7f9037e4524a]"]})
    handle({"pid": "gcs_server", "lines": [GONE, "", "  ", "still here"]})
    assert [batch["lines"] for batch in printed] == [
        ["step 10 done"],
        ["a later line"],
        [REAL_ERROR, "/lib/libc.so.6(+0x2724a) [0x7f9037e4524a]"],  # not after an abort
        ["still here"],
    ]
    assert _dropping_harmless(handle) is handle  # wrapping twice changes nothing
