"""Token data: text sources -> Parquet token shards + manifest -> a deterministic sequence order
-> Ray Data streams into each training worker. See docs/data.md."""
