"""The addresses a replica group advertises (trainer/groups/quorum.py): where the hostname resolves
to loopback (`vm` here, 127.0.1.1 on many images), groups on other nodes must be given the
Ray node IPs instead. No Ray is started: its two look-ups are replaced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_lm.trainer.groups import quorum
from raytrain_lm.trainer.groups.quorum import (
    NodeAddresses,
    interface_with,
    reachable_lighthouse,
    resolves_to_loopback,
)

pytestmark = pytest.mark.no_ray


def loopback(host: str) -> bool:
    return host in ("vm", "localhost", "127.0.0.1")


def test_lighthouse_on_loopback_is_reached_at_the_head_from_another_node():
    assert (
        reachable_lighthouse("http://vm:29510", "10.0.0.2", "10.0.0.1", loopback)
        == "http://10.0.0.1:29510"
    )


def test_lighthouse_address_kept_where_it_works():
    # the Lighthouse's own node (the head), where loopback reaches it
    assert reachable_lighthouse("http://vm:29510", "10.0.0.1", "10.0.0.1", loopback) == (
        "http://vm:29510"
    )
    # a hostname that resolves to a real address
    assert reachable_lighthouse("http://head-0:29510", "10.0.0.2", "10.0.0.1", loopback) == (
        "http://head-0:29510"
    )
    # head unknown, or no address at all
    assert reachable_lighthouse("http://vm:29510", "10.0.0.2", None, loopback) == "http://vm:29510"
    assert reachable_lighthouse("", "10.0.0.2", "10.0.0.1", loopback) == ""


def test_ipv6_head_is_bracketed():
    assert (
        reachable_lighthouse("http://vm:29510", "fd00::2", "fd00::1", loopback)
        == "http://[fd00::1]:29510"
    )


def test_loopback_resolution():
    assert resolves_to_loopback("127.0.1.1")
    assert resolves_to_loopback("localhost")
    assert not resolves_to_loopback("192.0.2.7")
    assert not resolves_to_loopback("no-such-host.invalid")


def test_interface_with():
    addr = SimpleNamespace
    interfaces = {
        "lo": [addr(address="127.0.0.1")],
        "eth0": [addr(address="10.0.0.2"), addr(address="fe80::1%eth0")],
    }
    assert interface_with("10.0.0.2", interfaces) == "eth0"
    assert interface_with("fe80::1", interfaces) == "eth0"
    assert interface_with("10.9.9.9", interfaces) is None


@pytest.fixture
def on_node(monkeypatch):
    """A worker on node 10.0.0.2 of a cluster whose head is 10.0.0.1, its hostname `vm`
    resolving to loopback, its Lighthouse address as Ray Train's TorchftConfig sets it."""
    import psutil
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    monkeypatch.setattr(
        ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.1:6379")
    )
    monkeypatch.setattr("socket.gethostname", lambda: "vm")
    monkeypatch.setattr(quorum, "resolves_to_loopback", loopback)
    monkeypatch.setattr(
        psutil,
        "net_if_addrs",
        lambda: {
            "lo": [SimpleNamespace(address="127.0.0.1")],
            "ens5": [SimpleNamespace(address="10.0.0.2")],
        },
    )
    monkeypatch.setenv(quorum.LIGHTHOUSE_ENV, "http://vm:29510")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)


def test_node_addresses(on_node):
    import os

    addresses = NodeAddresses()
    assert addresses.hostname == "10.0.0.2"
    assert addresses.lighthouse == "http://10.0.0.1:29510"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ens5"
    # the segment's name is made from Ray Train's address on every node: left alone
    assert os.environ[quorum.LIGHTHOUSE_ENV] == "http://vm:29510"


def test_gloo_interface_set_by_the_user_wins(on_node, monkeypatch):
    import os

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    NodeAddresses()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"
