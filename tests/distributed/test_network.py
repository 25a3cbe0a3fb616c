"""Which interface a multi-node TP group talks over, and LeaderWorkerSet's variables as the multi-node flags
(no ranks started: the choice itself, against this host's real interfaces)."""

from __future__ import annotations

import pytest

from servelm.config import ServerArgs
from servelm.distributed.failures import describe_remote_failure
from servelm.distributed.network import (
    InterfaceError,
    choose_interface,
    configure_tp_interface,
    leader_worker_set_defaults,
)


def test_the_route_to_the_rendezvous_host_picks_the_interface() -> None:
    assert choose_interface("127.0.0.1", 29500, env={}) == ("lo", "127.0.0.1", "the route to 127.0.0.1")


def test_a_named_interface_or_address_and_the_users_variable_win() -> None:
    assert choose_interface("10.1.2.3", 1, "lo", env={}) == ("lo", "127.0.0.1", "--dist-interface")
    assert choose_interface("10.1.2.3", 1, "127.0.0.1", env={}) == ("lo", "127.0.0.1", "--dist-interface")
    assert choose_interface("10.1.2.3", 1, env={"GLOO_SOCKET_IFNAME": "lo"})[::2] == ("lo", "GLOO_SOCKET_IFNAME")
    with pytest.raises(InterfaceError, match="'nosuch0' is neither an interface nor an address of this host"):
        choose_interface("127.0.0.1", 1, "nosuch0", env={})
    with pytest.raises(InterfaceError, match="cannot resolve the rendezvous host"):
        choose_interface("no-such-host.invalid", 1, env={})


def test_configure_sets_gloo_and_leaves_the_users_nccl_alone() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert configure_tp_interface("127.0.0.1", 29500, None, 1, env) == ("lo", "127.0.0.1")
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}


def test_leader_worker_set_variables_fill_the_multi_node_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    lws = {"LWS_LEADER_ADDRESS": "servelm-0.servelm", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    assert leader_worker_set_defaults(lws) == {"dist_init_addr": "servelm-0.servelm:20000", "nnodes": 2,
                                               "node_rank": 1}
    assert leader_worker_set_defaults({}) == {}
    for name, value in lws.items():
        monkeypatch.setenv(name, value)
    args = ServerArgs(tp_size=4)
    assert (args.dist_init_addr, args.nnodes, args.node_rank) == ("servelm-0.servelm:20000", 2, 1)
    assert ServerArgs(tp_size=4, dist_init_addr="10.0.0.1:1234").nnodes == 1  # a flag given: none is read
    assert ServerArgs().nnodes == 1  # TP 1: a single-node server inside the pod group


def test_a_lost_peer_is_named_by_the_address_it_announced() -> None:
    peers = ["10.0.0.1", "10.0.0.2"]
    reset = RuntimeError("[/x/gloo/pair.cc:537] Read error [10.0.0.2]:52891: Connection reset by peer")
    assert describe_remote_failure(reset, peers, 1).startswith(
        "TP rank 1 on node 1 (10.0.0.2) died or stopped answering (RuntimeError: Read error [10.0.0.2]:52891")
    timeout = RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    assert describe_remote_failure(timeout, peers, 1).startswith("TP rank 1 on node 1 (10.0.0.2)")
    three = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert describe_remote_failure(timeout, three, 1).startswith("a TP rank on another node died")
