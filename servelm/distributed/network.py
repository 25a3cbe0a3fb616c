"""Which network interface the ranks of a multi-node TP group talk over, and LeaderWorkerSet's defaults.

gloo (and NCCL's bootstrap) advertise the address that this host's *hostname* resolves to, unless
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name an interface. In many containers the hostname resolves to
127.0.0.1 or to an address no other host can reach, and the group then fails after the rendezvous with
"connectFullMesh failed ... Connection refused, remote=[127.0.0.1]". So, as vLLM (`VLLM_HOST_IP`) and SGLang
do, a rank of a multi-node group picks the interface that routes to the rendezvous host (`--dist-init-addr`),
unless the user named one: `--dist-interface` (an interface or one of its addresses), else their own
GLOO_SOCKET_IFNAME. The choice is logged.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping

import psutil

logger = logging.getLogger(__name__)

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LWS_DEFAULT_PORT = 20000  # the rendezvous port of SGLang's LeaderWorkerSet example


class InterfaceError(ValueError):
    """The named interface or address is not this host's, or nothing routes to the rendezvous host."""


def _addresses() -> dict[str, list[str]]:
    """Each interface's IPv4/IPv6 addresses (psutil, which reads them from the kernel)."""
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    return out


def _describe(addresses: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} {' '.join(ips) or '(no address)'}" for name, ips in sorted(addresses.items()))


def route_source_ip(host: str, port: int) -> str:
    """The local address this host would send from to reach host:port (a UDP connect: no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise InterfaceError(f"cannot resolve the rendezvous host {host!r} of --dist-init-addr: {exc}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as exc:
            raise InterfaceError(f"no route to the rendezvous host {host} ({exc}); name the interface with "
                                 "--dist-interface") from None
        return s.getsockname()[0]


def interface_of(ip: str, addresses: dict[str, list[str]] | None = None) -> str | None:
    """The interface that holds address `ip`."""
    target = ipaddress.ip_address(ip)
    for name, ips in (addresses if addresses is not None else _addresses()).items():
        if any(ipaddress.ip_address(a) == target for a in ips):
            return name
    return None


def choose_interface(host: str, port: int, spec: str | None = None,
                     env: MutableMapping[str, str] | None = None) -> tuple[str, str, str]:
    """(interface, its address, why) for the TP group's traffic: `spec` (--dist-interface: a name or an
    address), else the user's GLOO_SOCKET_IFNAME, else the interface of the route to host:port."""
    env = os.environ if env is None else env
    addresses = _addresses()
    if spec:
        if spec in addresses:
            return spec, (addresses[spec] or ["?"])[0], "--dist-interface"
        try:
            name = interface_of(spec, addresses)
        except ValueError:
            name = None
        if name is None:
            raise InterfaceError(f"--dist-interface {spec!r} is neither an interface nor an address of this host "
                                 f"(it has: {_describe(addresses)})")
        return name, spec, "--dist-interface"
    user = env.get("GLOO_SOCKET_IFNAME")
    if user:
        first = user.split(",")[0]
        return first, (addresses.get(first) or ["?"])[0], "GLOO_SOCKET_IFNAME"
    ip = route_source_ip(host, port)
    name = interface_of(ip, addresses)
    if name is None:
        raise InterfaceError(f"the route to {host} leaves from {ip}, which no interface holds (it has: "
                             f"{_describe(addresses)}); name one with --dist-interface")
    return name, ip, f"the route to {host}"


def configure_tp_interface(host: str, port: int, spec: str | None, rank: int,
                           env: MutableMapping[str, str] | None = None) -> tuple[str, str]:
    """Put the chosen interface in GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME, unless the user set it) for this
    rank's process groups; log it and return (interface, address)."""
    env = os.environ if env is None else env
    name, ip, why = choose_interface(host, port, spec, env)
    env["GLOO_SOCKET_IFNAME"] = name
    env.setdefault("NCCL_SOCKET_IFNAME", name)
    logger.info("TP rank %d talks to its peers over %s (%s), chosen by %s", rank, name, ip, why)
    return name, ip


def leader_worker_set_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, object]:
    """--dist-init-addr, --nnodes and --node-rank from LeaderWorkerSet's variables (LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE, LWS_WORKER_INDEX), for the flags left at their defaults; {} outside a LeaderWorkerSet."""
    env = os.environ if env is None else env
    leader, size, index = env.get("LWS_LEADER_ADDRESS"), env.get("LWS_GROUP_SIZE"), env.get("LWS_WORKER_INDEX")
    if not (leader and size and index):
        return {}
    try:
        nnodes, node_rank = int(size), int(index)
    except ValueError:
        return {}
    host = f"[{leader}]" if ":" in leader else leader
    return {"dist_init_addr": f"{host}:{LWS_DEFAULT_PORT}", "nnodes": nnodes, "node_rank": node_rank}
