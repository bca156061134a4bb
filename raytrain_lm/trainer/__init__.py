"""Training: `driver/` (what the driver runs), `entry` (what Ray Train runs in each worker,
the only module calling Ray Train's per-worker API beside `eval_entry`), `worker` (one
worker's run), `components/` (the loop's parts), `distributed/` (the model spread over the
workers), `checkpointing/`, `groups/` (replica groups on torchft), `syncs/` (DiLoCo), `spec`
(what the driver hands each worker), `chaos` (fault injection for chaos tests)."""
