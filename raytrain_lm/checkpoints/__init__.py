"""The checkpoint format, read by training and by everything that uses a run's results
(generation, export, evaluation, sweeps): what a checkpoint holds (contents), when it is
complete and intact (markers), writing and uploading one (writing), reading one back
(reading), a run's checkpoints (in_run), and FSDP's sharded ones (sharded)."""

from raytrain_lm.checkpoints.contents import (
    CONFIG_FILE,
    KEEP_FILE,
    MARKER_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PART_PREFIX,
    STATE_FILE,
    TrainState,
    check_strategy_resumes,
    load_model_state,
    model_state,
    same_format,
    tied_aliases,
)
from raytrain_lm.checkpoints.in_run import (
    best_checkpoint,
    complete_checkpoints,
    ever_checkpointed,
    latest_complete_checkpoint,
    prune_checkpoints,
)
from raytrain_lm.checkpoints.markers import damage, file_listing, is_complete, part_marker
from raytrain_lm.checkpoints.reading import load_checkpoint, local_copy, read_state, restore_newest
from raytrain_lm.checkpoints.writing import save_checkpoint, upload_checkpoint

__all__ = [
    "CONFIG_FILE",
    "KEEP_FILE",
    "MARKER_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "PART_PREFIX",
    "STATE_FILE",
    "TrainState",
    "best_checkpoint",
    "check_strategy_resumes",
    "complete_checkpoints",
    "damage",
    "ever_checkpointed",
    "file_listing",
    "is_complete",
    "latest_complete_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "local_copy",
    "model_state",
    "part_marker",
    "prune_checkpoints",
    "read_state",
    "restore_newest",
    "same_format",
    "save_checkpoint",
    "tied_aliases",
    "upload_checkpoint",
]
