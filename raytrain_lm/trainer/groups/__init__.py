"""Who a worker trains with, chosen by `scaling.fault_tolerance` (entry.py): `static` (restart:
one Ray Train group, any incident ends it) or `replicas` (torchft replica groups that others
join and leave), with the replica group's parts: `replica_step` (a step's shares, sums and
vote), `sums` (the typed packer of values summed across groups), `membership`, `healing`,
`chief` (only the chief's metrics go out), `quorum` (the Lighthouse, the Manager), `roster`,
`torchft_adapter` (every use of torchft's private attributes); `start` and `feed` (a group's
start record and data stream)."""
