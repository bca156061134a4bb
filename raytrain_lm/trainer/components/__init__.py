"""The worker loop's parts, each built from its own config: `parts` (what they share, one typed
record), `state` (where the run is, and the one place it moves on), `trainee` (the model as
laid out, its optimizer and batch plan), `step` (one optimizer step), `cadence` (every N steps
or S seconds), `metrics` (what a read logs), `evaluation`, `journal` (the group's events and
heartbeats), `batch_plan`, `balance` and `rebalancing` (each rank's share by speed),
`pending_values` (values kept on the device until read), `watchdog`, `stop_requests` (stop and
spot notices), `budget` and `spot_first` (the chief's account against money and a
deadline)."""
