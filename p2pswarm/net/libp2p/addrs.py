"""Addresses and one-line errors for the libp2p layer: parsing multiaddrs and peer addresses,
circuit (relayed) addresses, listen-address checks, and turning py-libp2p's nested exceptions into
one line. Nothing here needs a running host, so the relay service, the CLI and the host share it."""
from __future__ import annotations

import re

from typing import Sequence

import multiaddr
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2pswarm.errors import UserError, clip

PROTOCOL_CIRCUIT = "p2p-circuit"
DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"


class NetError(UserError):
    """A peer that cannot be dialled, or a stream that cannot be opened, in one line."""


def parse_multiaddr(text: str, what: str = "address") -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise UserError(f"bad {what} {clip(text, 200)!r}: {clip(exc, 200) or 'not a multiaddr'} "
                        f"(expected e.g. /ip4/127.0.0.1/tcp/4001)") from None


def parse_peer_addr(text: str) -> PeerInfo:
    """``/ip4/H/tcp/P/p2p/PEERID`` -> PeerInfo; a clear error for anything else."""
    ma = parse_multiaddr(text, "peer address")
    try:
        peer = ma.get_peer_id()
    except Exception:
        peer = None
    if not peer:
        raise UserError(f"peer address {clip(text, 200)!r} lacks its /p2p/PEERID part "
                        f"(the bootstrap node prints its full address at start)")
    try:
        pid = ID.from_base58(peer)
    except Exception:
        raise UserError(f"peer address {clip(text, 200)!r}: malformed peer id {clip(peer, 120)!r}") from None
    base = ma.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer}"))
    return PeerInfo(pid, [base])


def is_wildcard(ma: multiaddr.Multiaddr) -> bool:
    for proto in ("ip4", "ip6"):
        try:
            if ma.value_for_protocol(proto) in ("0.0.0.0", "::"):
                return True
        except Exception:
            pass
    return False


def is_circuit_addr(ma) -> bool:
    """Whether a multiaddr goes through a relay (``.../p2p/RELAY/p2p-circuit[/p2p/PEER]``)."""
    try:
        return PROTOCOL_CIRCUIT in {p.name for p in multiaddr.Multiaddr(str(ma)).protocols()}
    except Exception:
        return False


def circuit_addr(relay_addr: str | multiaddr.Multiaddr, peer: str | None = None) -> str:
    """``RELAY_ADDR/p2p/RELAY_ID`` -> ``RELAY_ADDR/p2p/RELAY_ID/p2p-circuit[/p2p/PEER]``."""
    text = str(relay_addr).rstrip("/")
    out = f"{text}/{PROTOCOL_CIRCUIT}"
    return f"{out}/p2p/{peer}" if peer else out



def error_reason(exc: BaseException) -> str:
    """One line out of py-libp2p's nested exceptions."""
    parts, seen = [], 0
    cur: BaseException | None = exc
    while cur is not None and seen < 4:
        text = str(cur).strip().splitlines()[0] if str(cur).strip() else type(cur).__name__
        if text not in parts:
            parts.append(clip(text, 200))
        cur = cur.__cause__ or (cur.exceptions[0] if isinstance(cur, BaseExceptionGroup) else None)
        seen += 1
    return ": ".join(parts)


def id_mismatch(exc: BaseException) -> str | None:
    """The peer id that actually answered, when a dial failed because the peer at the address has
    another id than the address's ``/p2p/`` part (Noise proves the key; py-libp2p buries that
    under four wrappers). Why: a mistyped or stale bootstrap address otherwise reads as
    'handshake failed', which sends the user looking at the network."""
    todo, seen = [exc], 0
    while todo and seen < 16:
        e = todo.pop()
        seen += 1
        if type(e).__name__ == "PeerIDMismatchesPubkey":
            found = re.search(r"remote_peer_id_from_pubkey=(\w+)", str(e))
            return found.group(1) if found else "another id"
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        todo += list(getattr(e, "errors", None) or getattr(e, "exceptions", None) or ())
    return None



def check_listen_addrs(addrs: Sequence[multiaddr.Multiaddr], *, tls: bool) -> None:
    """TCP, WebSocket (``/ws``) or TLS WebSocket (``/wss``, needs a certificate) over IPv4/IPv6;
    no two of them on one host and port (py-libp2p puts listeners sharing a port behind its demultiplexer, which breaks
    WebSocket upgrades: see p2pswarm.net.libp2p.patches)."""
    seen: dict[tuple[str, str], multiaddr.Multiaddr] = {}
    for a in addrs:
        names = [p.name for p in a.protocols()]
        ok = (len(names) in (2, 3) and names[0] in ("ip4", "ip6") and names[1] == "tcp"
              and (len(names) == 2 or names[2] in ("ws", "wss")))
        if not ok:
            raise UserError(f"listen address {a} is not TCP or WebSocket over IPv4/IPv6 "
                            f"(expected /ip4/HOST/tcp/PORT, /ip4/HOST/tcp/PORT/ws or .../wss)")
        if "wss" in names and not tls:
            raise UserError(f"listen address {a} is /wss: give a TLS certificate and key (--tls-cert, --tls-key)")
        key = (a.value_for_protocol(names[0]), a.value_for_protocol("tcp"))
        if key in seen and ({"ws", "wss"} & (set(names) | {p.name for p in seen[key].protocols()})):
            raise UserError(f"listen addresses {seen[key]} and {a} share port {key[1]}: give each transport "
                            f"its own explicit port (e.g. /tcp/4001 and /tcp/443/wss)")
        seen[key] = a


