"""What the driver prints of Ray's worker output (raytrain_lm/console.py): the known
harmless Ray messages (and blank lines) are dropped, every other line passes, errors included;
Ray's notice that token authentication is on is dropped, its warning that it is off stays."""

from __future__ import annotations

import logging

import pytest

from raytrain_lm.console import TOKEN_AUTH_LOGGER, _dropping_harmless, quiet_token_auth_notice

pytestmark = pytest.mark.no_ray

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


# As a notebook's Ray printed them next to another Ray on the machine: the cleaner, finding
# several, asked the other about its controller, was told it is gone, and exited.
CLEANER_LOST = [
    "Found multiple active Ray instances: {'192.0.2.2:45515', '192.0.2.2:42979'}. Connecting to "
    "latest cluster at 192.0.2.2:42979. You can override this by setting the `--address` flag "
    "or `RAY_ADDRESS` environment variable."
]
UNREGISTERED = [
    "Failed to register placement group with cleaner: The actor died unexpectedly before "
    "finishing this task.",
    "\tclass_name: PlacementGroupCleaner",
    "\tactor_id: ebebbd7109df27e220affa2001000000",
    "\tpid: 22929",
    "\tnamespace: 7b66999c-318f-4513-9c48-235f4ed752bc",
    "\tip: 192.0.2.2",
    "The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT "
    "Worker exit detail: User requested to exit the actor.. Placement group may not be cleaned "
    "up if controller dies ungracefully.",
]
# The controller's, as a notebook printed it at the end of a run, when the cleaner (stuck
# asking another Ray about the controller) did not stop within its timeout.
UNSTOPPED = [
    "Failed to stop PlacementGroupCleaner gracefully.",
    "Traceback (most recent call last):",
    '  File "/venv/ray/train/v2/_internal/callbacks/placement_group_callback.py", line 126, '
    "in _stop_cleaner",
    "    ray.get(self._cleaner.stop.remote(), timeout=self._stop_timeout)",
    '  File "python/ray/includes/common.pxi", line 107, in ray._raylet.check_status',
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]
CLEANED_UP = (
    "Detected that the Ray Train controller actor (3e36550fd8e57b6cd0e5612501000000) is dead. "
    "Cleaning up placement group = [PlacementGroupID(02385af41ea348028c5744f11a9c01000000)] "
    "created by this run."
)


def test_ray_trains_placement_group_cleaner_says_nothing():
    """Its notes (freeing a stopped run's placement group; where it cannot find its own
    cluster, a notebook's Ray beside another, its search and its slow stop) and the
    controller's 7-line block and traceback about it: dropped. The same words from another
    process pass, as do the controller's other output and any other error."""
    printed: list[dict] = []
    handle = _dropping_harmless(printed.append)
    stuck = "Monitor thread did not exit within 12.00 seconds"
    cleaner = [*CLEANER_LOST, CLEANED_UP, stuck]
    handle({"pid": 1, "actor_name": "PlacementGroupCleaner", "lines": cleaner})
    handle({"pid": 2, "actor_name": "TrainController", "lines": UNREGISTERED[:3]})
    handle({"pid": 2, "actor_name": "TrainController", "lines": [*UNREGISTERED[3:], "step 1"]})
    handle({"pid": 2, "actor_name": "TrainController", "lines": [*UNSTOPPED, "step 2"]})
    handle({"pid": 3, "actor_name": "run_trial", "lines": CLEANER_LOST})
    lost = [
        "Exception in thread PlacementGroupCleanerMonitor:",
        "Traceback (most recent call last):",
        '  File "/venv/ray/dashboard/utils.py", line 688, in ray_address_to_api_server_url',
        "ray.exceptions.RpcError: Timed out while waiting for GCS to become available.",
    ]
    handle({"pid": 1, "actor_name": "PlacementGroupCleaner", "lines": lost})
    failed = [*UNSTOPPED[:-1], "ValueError: not a timeout"]  # another error passes whole
    handle({"pid": 4, "actor_name": "TrainController", "lines": [*failed, "step 3"]})
    assert [batch["lines"] for batch in printed] == [
        ["step 1"],
        ["step 2"],
        CLEANER_LOST,
        [*failed, "step 3"],
    ]


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_rays_notice_that_token_auth_is_on_is_dropped():
    """Token authentication stays on; Ray's notice saying so at every new local Ray goes, its
    warning that authentication is off stays."""
    quiet_token_auth_notice()
    logger, kept = logging.getLogger(TOKEN_AUTH_LOGGER), _Kept()
    logger.addHandler(kept)
    try:
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with")
    finally:
        logger.removeHandler(kept)
    assert kept.messages == ["Token authentication is disabled for this Ray cluster. Anyone with"]
