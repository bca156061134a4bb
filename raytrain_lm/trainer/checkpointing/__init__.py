"""A training run's checkpoints (the format itself is raytrain_lm.checkpoints): `restore`
(which checkpoint a group resumes from), `chief_uploads` (replica groups' uploads),
`checkpoint_interval` (`checkpoint.every_steps: auto`)."""
