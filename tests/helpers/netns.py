"""Network namespaces for the soak (bench/soak.py): a node in a namespace of its own, joined to the
root namespace by a veth pair, its traffic shaped by nftables *inside* that namespace only (so
nothing outside the namespaces we made is touched, and deleting a namespace deletes its rules).

* :meth:`Netns.nat` - a NAT as a phone sits behind: no inbound connection, outbound only to the
  listed (host, port)s, source addresses masqueraded onto the namespace's end of the veth.
* :meth:`Netns.partition` / :meth:`Netns.slow` / :meth:`Netns.heal` - faults: every packet on the
  veth dropped (a partition), or both directions rate-limited (a slow link), then undone.

Needs root, ``ip`` and ``nft`` (``python tests/system_tools.py`` installs them).
"""
from __future__ import annotations

import os
import subprocess

PREFIX = "p2ps-soak-"  # every namespace this module makes; cleanup_stale removes leftovers by it


def sh(*cmd: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


NAT_RULES = """
table inet p2ps_nat {{
    chain input {{
        type filter hook input priority 0; policy drop;
        iif "lo" accept
        ct state established,related accept
    }}
    chain output {{
        type filter hook output priority 0; policy drop;
        oif "lo" accept
        ct state established,related accept
{allowed}
    }}
    chain post {{
        type nat hook postrouting priority 100;
        oif "{ns_if}" masquerade
    }}
}}
"""

FAULT_RULES = """
table inet p2ps_fault {{
    chain input {{
        type filter hook input priority -10; policy accept;
        iif "{ns_if}" {verdict}
    }}
    chain output {{
        type filter hook output priority -10; policy accept;
        oif "{ns_if}" {verdict}
    }}
}}
"""


class Netns:
    """A namespace ``p2ps-soak-<tag>`` at ``10.<net_hi>.<net>.2``, its root-side peer at ``.1``."""

    def __init__(self, tag: str, net: int, net_hi: int = 233):
        self.name = f"{PREFIX}{tag}"
        self.host_if, self.ns_if = f"p2pk{tag}"[:15], f"p2pn{tag}"[:15]
        self.host_ip, self.ns_ip = f"10.{net_hi}.{net}.1", f"10.{net_hi}.{net}.2"
        self.up = False
        self.fault: str | None = None

    @property
    def prefix(self) -> list[str]:
        """Put before a command to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def create(self) -> Netns:
        sh("ip", "netns", "add", self.name)
        self.up = True
        sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        sh("ip", "link", "set", self.ns_if, "netns", self.name)
        sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        sh("ip", "link", "set", self.host_if, "up")
        sh(*self.prefix, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
        sh(*self.prefix, "ip", "link", "set", self.ns_if, "up")
        sh(*self.prefix, "ip", "link", "set", "lo", "up")
        return self

    def nft(self, rules: str) -> None:
        sh(*self.prefix, "nft", "-f", "-", input=rules)

    def nat(self, allowed: list[tuple[str, int]]) -> None:
        """Behind a NAT: nothing may connect in; out only to ``allowed``, masqueraded."""
        lines = "\n".join(f"        ip daddr {h} tcp dport {p} accept" for h, p in allowed)
        self.nft(NAT_RULES.format(allowed=lines, ns_if=self.ns_if))

    def partition(self) -> None:
        """Drop every packet on the link (both ways): connections stall, nothing is refused."""
        self._fault("drop", "partition")

    def slow(self, kbytes_s: int) -> None:
        """Rate-limit the link to ``kbytes_s`` kB/s each way (excess packets dropped: TCP backs off)."""
        self._fault(f"limit rate over {int(kbytes_s)} kbytes/second drop", "slow")

    def heal(self) -> None:
        if self.fault:
            sh(*self.prefix, "nft", "delete", "table", "inet", "p2ps_fault", check=False)
            self.fault = None

    def _fault(self, verdict: str, kind: str) -> None:
        self.heal()
        self.nft(FAULT_RULES.format(ns_if=self.ns_if, verdict=verdict))
        self.fault = kind

    def delete(self) -> None:
        """Remove the namespace (its nftables tables and its end of the veth go with it)."""
        if self.up:
            sh("ip", "netns", "del", self.name, check=False)
            sh("ip", "link", "del", self.host_if, check=False)
            self.up = False


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs that are gone (killed before their own cleanup): their names
    are ``p2ps-soak-<pid><i>``, and a live ``<pid>``'s are left alone. Returns the names deleted."""
    out = sh("ip", "netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):-1]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            sh("ip", "netns", "del", name, check=False)
            sh("ip", "link", "del", f"p2pk{name[len(PREFIX):]}"[:15], check=False)
            gone.append(name)
    return gone
