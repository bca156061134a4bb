"""Replica groups (`scaling.fault_tolerance=replicas`) on torchft: `replicas` (the group's
worker), `quorum` (the Lighthouse, the Manager, the chief's views), `roster` (what groups tell
each other each step), `torchft_adapter` (every use of torchft's private attributes)."""
