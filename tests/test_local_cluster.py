"""The local multi-node Ray the chaos tests build (raytrain_lm/clusters/multinode.py)."""

from __future__ import annotations

import socket

import pytest

from raytrain_lm.clusters import multinode

pytestmark = pytest.mark.chaos  # starts a Ray of its own in this process


def test_a_head_whose_dashboard_port_was_taken_starts_on_another(monkeypatch, capsys):
    """The head's dashboard port is one that was free when chosen; something else may take it
    before the dashboard binds it (in CI, the head's own GCS did). The head starts again on a
    new port instead of failing the tests that wanted a cluster."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    chosen = multinode.free_port
    monkeypatch.setattr(multinode, "free_port", lambda: next(ports, None) or chosen())
    cluster = multinode.LocalCluster(workers=0)
    try:
        import ray

        said = capsys.readouterr().out
        assert "a Ray node did not start (because it's already occupied); retrying (1/3)" in said
        assert not cluster.api_server.endswith(f":{taken.getsockname()[1]}")
        assert ray.cluster_resources()["CPU"] == 2
        assert len([node for node in ray.nodes() if node["Alive"]]) == 1
    finally:
        cluster.shutdown()
        taken.close()
