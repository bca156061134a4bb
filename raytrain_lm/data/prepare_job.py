"""The Ray Data job each pass of `prepare` runs over the inputs (finding duplicates, building a
char alphabet or a BPE sample, tokenizing): one task per group of inputs, in input order, each
returning small rows to the driver."""

from __future__ import annotations

from collections.abc import Iterator

from raytrain_lm.data.pipeline import ordered_dataset
from raytrain_lm.data.sources import InputFile

READ_TASK_BYTES = 32 * 2**20


def map_input_groups(inputs: list[InputFile], udf, tell_parallel: bool = False, **fn_kwargs):
    """`udf` mapped over groups of inputs, in input order, as a Ray Data dataset. With
    `tell_parallel`, the udf learns whether there are fewer groups than CPUs (then a task
    may use more than one thread)."""
    import ray

    items = [
        {"group": n, "uri": i.uri, "size": i.size, "mtime_ns": i.mtime_ns, "source": i.source}
        for n, i in enumerate(inputs)
    ]
    # One read task per ~READ_TASK_BYTES of input, at least a few per CPU: a task per small
    # file (the standard library has hundreds) costs more in scheduling than in reading.
    total = sum(i.size for i in inputs)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    blocks = max(1, min(len(items), max(4 * cpus, total // READ_TASK_BYTES + 1)))
    if tell_parallel:
        fn_kwargs["parallel"] = blocks < cpus
    return ordered_dataset(items, blocks).map_batches(
        udf, fn_kwargs=fn_kwargs, batch_size=None, batch_format="pyarrow"
    )


def metadata_rows(dataset) -> Iterator[dict]:
    """The rows of a dataset of small metadata rows, in order."""
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        yield from batch.to_pylist()
