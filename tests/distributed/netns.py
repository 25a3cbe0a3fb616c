"""Hosts for multi-node tests: Linux network namespaces, each with its own network stack and an `eth0` on a
shared bridge, as separate machines on one switch. Only root can make them; `make_hosts` skips the test with the
reason when it cannot."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Hosts:
    """`n` namespaces `<prefix>h0..`, host i at `<subnet>.(i+1)`; the test's own namespace reaches them at
    `<subnet>.254` through the bridge."""

    prefix: str
    subnet: str
    n: int
    made: list[str] = field(default_factory=list)

    def name(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, veth = self.name(i), f"{self.prefix}v{i}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, i: int, up: bool) -> None:
        """Take host i's network cable out (or put it back)."""
        _ip("-n", self.name(i), "link", "set", "eth0", "up" if up else "down")

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run on host i: in its namespace, with a hostname of its own that resolves nowhere."""
        script = f"hostname {self.name(i)} && exec \"$@\""
        return ["ip", "netns", "exec", self.name(i), "unshare", "--uts", "--", "sh", "-c", script, "sh", *argv]

    def teardown(self) -> None:
        for i in range(self.n):  # a namespace's end of a veth pair goes with it, but not always the other end
            subprocess.run(["ip", "link", "del", f"{self.prefix}v{i}"], capture_output=True, timeout=30)
        for ns in reversed(self.made):
            if ns == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            else:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()


def make_hosts(n: int) -> Hosts:
    """`n` fresh hosts (call `teardown()` when done); skips the calling test where namespaces cannot be made."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network-namespace hosts need iproute2's `ip` and util-linux's `unshare`")
    if os.geteuid() != 0:
        pytest.skip("network-namespace hosts need root (ip netns add)")
    tag = f"sl{os.getpid() % 1000:03d}{random.randrange(100):02d}"  # short: interface names stop at 15 bytes
    hosts = Hosts(tag, f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}", n)
    try:
        hosts.setup()
    except subprocess.CalledProcessError as exc:
        hosts.teardown()
        pytest.skip(f"cannot make network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    return hosts
