"""A training run's checkpoints (the format itself is raytrain_lm.checkpoints): `writer` (the
ledger and the checkpoint, published where the group says), `resume` and `restore` (which
checkpoint a group resumes from), `chief_uploads` (replica groups' uploads),
`checkpoint_interval` (`checkpoint.every_steps: auto`)."""
