"""Where the ranks of tensor/pipeline parallelism listen (kvserve.runner.ranks): on one machine
the store and gloo bind 127.0.0.1 only, whatever --master-addr or GLOO_SOCKET_IFNAME say; across
machines, node 0's --master-addr; a bad address or a busy port is a ValueError saying which."""

import os
import socket

import psutil
import pytest

from kvserve.config import DistributedConfig, resolve_distributed
from kvserve.runner import ranks


def _listening(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_one_machine_meets_on_loopback_whatever_the_master_addr():
    assert ranks.meeting_host(resolve_distributed(2, env={})) == "127.0.0.1"
    one_node = resolve_distributed(2, nnodes=1, master_addr="10.0.0.9", env={})
    assert ranks.meeting_host(one_node) == "127.0.0.1"
    two_nodes = resolve_distributed(2, nnodes=2, node_rank=0, master_addr="10.0.0.9", env={})
    assert ranks.meeting_host(two_nodes) == "10.0.0.9"


def test_the_store_listens_on_the_meeting_address_only():
    d = DistributedConfig(world=2, local_ranks=2, spawn=1, master_addr="0.0.0.0")
    store = ranks._store(d, 0, master=True)
    assert _listening(store.port) == ["127.0.0.1"]
    worker = DistributedConfig(world=2, master_addr="127.0.0.1")
    client = ranks._store(worker, store.port, master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # Across machines it is node 0's --master-addr (here one of this machine's addresses).
    d = DistributedConfig(world=2, local_ranks=1, master_addr="127.0.0.1", master_port=0)
    store = ranks._store(d, 0, master=True)
    assert _listening(store.port) == ["127.0.0.1"]


def test_a_busy_port_or_a_foreign_address_says_which(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"--master-port {port}: .* in use"):
            ranks._listen("127.0.0.1", port)
    with pytest.raises(ValueError, match="is not an address of this machine"):
        ranks._listen("198.51.100.7", 0)  # TEST-NET-2: no machine's own address
    with pytest.raises(ValueError, match="--master-addr no-such-host.invalid: cannot resolve"):
        ranks._listen("no-such-host.invalid", 0)


def test_gloo_binds_the_loopback_interface_on_one_machine(monkeypatch):
    loopback = ranks.gloo_interface("127.0.0.1")
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[loopback]]
    one_machine = resolve_distributed(2, env={})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-public")  # asked for: one machine ignores it
    with ranks._gloo_bound(one_machine):
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth-public"  # and puts it back
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with ranks._gloo_bound(one_machine):
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback
    assert "GLOO_SOCKET_IFNAME" not in os.environ
