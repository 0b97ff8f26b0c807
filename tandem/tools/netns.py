"""Separate network hosts on one machine: each process of a stack in a Linux network namespace of
its own, joined to this one by a veth link, with a delaying TCP proxy on every link between them.

    this namespace (the harness, clients)            10.213.255.1 on lo: the "switch"
      ├── veth 10.213.0.1 ─── 10.213.0.2  tdm<run>-valkey
      ├── veth 10.213.1.1 ─── 10.213.1.2  tdm<run>-drafter
      ├── veth 10.213.2.1 ─── 10.213.2.2  tdm<run>-verifier-0     (10.213.3.x: verifier-1, ...)
      └── veth 10.213.9.1 ─── 10.213.9.2  tdm<run>-gateway

No namespace can reach another directly: each has a route to its own link and to the switch
address only, and this namespace does not forward. Every connection from one service to another
goes to a DelayProxy listening on the switch address (one per server: the drafter's link, each
verifier's link, Valkey's), so delay, jitter and dropped connections are set per link (`tc netem`
is not available here). Clients in this namespace reach the gateway at its own address.

Every address and name is made by the harness and removed by `close()`; traffic goes nowhere
else. Needs root (CAP_NET_ADMIN) and `ip` (iproute2); `available()` says why not, where not.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid

from tandem.tools.stack import Topology

log = logging.getLogger("tandem.tools.netns")

SWITCH = "10.213.255.1"
_GATEWAY_NET = 9
_PORTS = {"valkey": 6379, "drafter": 50052, "gateway": 8000}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here; else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tdmprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    if _ip("-4", "addr", "show", "to", "10.213.0.0/16", check=False).stdout.strip():
        return "10.213.0.0/16 is already in use on this host"
    return None


class NetnsTopology(Topology):
    """A Topology (tandem/tools/stack.py) of namespaces; `verifiers` sets how many links to make."""

    private = True  # the namespaces' addresses exist on this host only

    def __init__(self, verifiers: int = 1, run_id: str | None = None):
        super().__init__(host=SWITCH, proxied=("valkey", "drafter", "verifier"))
        why = available()
        if why is not None:
            raise RuntimeError(f"no network namespaces here: {why}")
        self.run_id = run_id or uuid.uuid4().hex[:5]
        self._nets = {"valkey": 0, "drafter": 1, "gateway": _GATEWAY_NET}
        for i in range(verifiers):
            self._nets[f"verifier-{i}"] = 2 + i
        if verifiers > _GATEWAY_NET - 2:
            raise ValueError(f"at most {_GATEWAY_NET - 2} verifiers")
        self._made: list[tuple[str, str]] = []  # (namespace, root-side veth)
        self._switch = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, role: str) -> str:
        return f"tdm{self.run_id}-{role}"

    def _build(self) -> None:
        _ip("addr", "add", f"{SWITCH}/32", "dev", "lo")
        self._switch = True
        for role, net in self._nets.items():
            ns, outer, inner = self.namespace(role), f"tdm{self.run_id}h{net}", f"tdm{self.run_id}n{net}"
            _ip("netns", "add", ns)
            self._made.append((ns, outer))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"10.213.{net}.1/30", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"10.213.{net}.2/30", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            # The switch address, and nothing beyond it: no default route.
            _ip("route", "add", f"{SWITCH}/32", "dev", inner, "src", f"10.213.{net}.2", ns=ns)
        log.info("network namespaces %s", ", ".join(ns for ns, _ in self._made))

    # -- Topology -------------------------------------------------------------------------------

    def bind(self, role: str) -> str:
        return f"10.213.{self._nets[role]}.2"

    def port(self, role: str) -> int:
        return _PORTS.get(role.split("-")[0], 50061)  # a namespace of its own: every port is free

    def metrics_port(self, role: str) -> int:
        return 9464

    def wrap(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(role)]

    def proxy_host(self, server: str) -> str:
        return SWITCH

    def close(self) -> None:
        super().close()
        for ns, outer in reversed(self._made):
            _ip("link", "del", outer, check=False)
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        if self._switch:
            _ip("addr", "del", f"{SWITCH}/32", "dev", "lo", check=False)
            self._switch = False
