"""Training. Driver side: `launch` (check, prepare, track, run worker groups until done),
`stopping` (graceful stop on SIGTERM/Ctrl-C), `capacity` (Ray Train's view of the cluster),
`callbacks` (a Ray Train callback for failures). Worker side: `loop` (the one module calling
Ray Train's per-worker API) and the parts it drives: `step`, `evaluation`, `checkpoint`,
`signals`, `goodput`, `cadence`, `plan`, `hardware`, `progress`, `watchdog`, `faults`.
The two sides share `spec` (what the driver hands each worker)."""
