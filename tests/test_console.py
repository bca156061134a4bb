"""What the driver prints of Ray's worker output (raytrain_lm/console.py): the known
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
# As a Train worker printed it in CI's sweep notebook, three times (the stats actor had been
# made again and knew none of the running pipelines).
STATS_ERROR = [
    "Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): \x1b[36mray::_StatsActor."
    "update_execution_metrics()\x1b[39m (pid=10573, ip=192.0.2.2, actor_id=d4f99d1b5be795d364, "
    "repr=<ray.data._internal.stats._StatsActor object at 0x7fca334757d0>)",
    '  File "/venv/ray/data/_internal/stats.py", line 836, in update_execution_metrics',
    "    self.update_dataset(dataset_tag, state)",
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/venv/ray/data/_internal/stats.py", line 934, in update_dataset',
    "    self.datasets[dataset_tag].update(state)",
    "    ~~~~~~~~~~~~~^^^^^^^^^^^^^",
    "KeyError: 'raytrain_lm_0359O6QOeOrT5Rht19TVXP_0'",
]


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


def test_a_stats_actor_error_about_our_pipeline_is_dropped_any_other_passes_whole():
    printed: list[dict] = []
    handle = _dropping_harmless(printed.append)
    handle({"pid": 7, "lines": STATS_ERROR[:3]})  # an error may arrive in several batches
    handle({"pid": 7, "lines": [*STATS_ERROR[3:], "step 2"]})
    theirs = [*STATS_ERROR[:-1], "KeyError: 'dataset_12_0'"]  # not a pipeline of ours
    other = [*STATS_ERROR[:-1], "ValueError: bad state"]
    handle({"pid": 8, "lines": [*theirs, *other, "step 3"]})
    assert [batch["lines"] for batch in printed] == [["step 2"], [*theirs, *other, "step 3"]]
