"""The driver side of a training run: `launch` (check, prepare, track, run worker groups until
done), `fit` (one TorchTrainer.fit()), `callbacks` (Ray Train controller callbacks),
`capacity` (Ray Train's view of the cluster), `replica_placement` (a lost replica group
replaced only where it can start), `stopping` (graceful stop), `publish` (what a run leaves),
`storage_checks` (folders every node must see)."""
