"""What every Ray Data pipeline of the data package shares: its settings, and how its tasks
report a problem with the user's data.

A UserError met inside a map task is not raised out of it. Ray 2.60 would wrap it in a
`UserCodeException` whose cause does not survive the trip to the caller (a generator UDF's
does, with Ray's retry advice appended to its message), and Ray Data would log it as a
failure of its own, with a traceback. A task returns the message instead, on a row of its
output, in ERROR_COLUMN (which holds no message on any other row); the consumer raises it when it reaches
that row, so the user gets the one line that names the file or shard.
"""

from __future__ import annotations

from raytrain_lm.console import DATASET_NAME_PREFIX, quiet_ray_data

ERROR_COLUMN = "error"


def ordered_dataset(items: list[dict], num_blocks: int):
    """`items` as a Ray Data dataset whose pipelines keep their blocks in input order (the
    token stream follows the inputs; a worker's batches follow positions) and print nothing of
    their own: no progress bars (`prepare` draws its own), no execution plan, no finish line
    (see `console`). The settings go on this dataset's own copy of the context, so the
    caller's other Ray Data pipelines keep the process's settings; the dataset is named
    `raytrain_lm` (in Ray Data's logs and dashboard)."""
    import ray.data

    quiet_ray_data()
    dataset = ray.data.from_items(items, override_num_blocks=num_blocks)
    dataset.set_name(DATASET_NAME_PREFIX)
    dataset.context.execution_options.preserve_order = True
    dataset.context.enable_progress_bars = False
    dataset.context.print_on_execution_start = False
    return dataset
