"""Runs beyond a single local Ray: product code for clusters, and the local multi-node Ray the
chaos tests, the recovery benchmark and the elastic notebook use.

- `jobs`: `raytrain-lm submit|status|logs|stop`, runs as Ray jobs on a (remote) cluster.
- `autoscaling`: `raytrain-lm cluster up|down`, cluster/local.yaml on one machine: an autoscaling
  Ray whose worker nodes are fake (extra raylets advertising GPUs they do not have).
- `fake_nodes`: the node provider that autoscaler loads to start those fake nodes.
- `multinode`: a head and worker nodes in this process, killed, drained and added on demand.

Where a run's workers may go on any cluster is `raytrain_lm.placement`.
"""
