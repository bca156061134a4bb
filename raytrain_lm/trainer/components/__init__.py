"""The worker loop's parts, each built from its own config: `step` (one optimizer step),
`cadence` (every N steps or S seconds), `evaluation`, `batch_plan`, `balance` and
`rebalancing` (each rank's share by speed), `pending_values` (values kept on the device until
read), `progress`, `watchdog`, `stop_requests` (stop and spot notices), `group_endings` (how a
worker group ends: checkpoints written, reported, uploaded), `budget` and `spot_first` (the
chief's account against money and a deadline)."""
