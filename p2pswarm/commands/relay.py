"""`p2pswarm relay`: a circuit relay v2 (HOP) on WebSocket for NATed workers, and a DHT bootstrap server.

    p2pswarm relay --listen /ip4/0.0.0.0/tcp/8080/ws --announce /dns4/relay.example.com/tcp/443/wss \\
        --trust-issuer 12D3KooW... --health 127.0.0.1:8081

Reservations only for peers that show a node token (``p2pswarm token issue --allow relay``) of a
trusted issuer; ``--open`` runs an open relay instead. Limits come from flags or ``--config
relay.toml`` (flags win). Prints ``READY <multiaddr> health=<url|off>``; stops cleanly on
SIGINT/SIGTERM. See p2pswarm/relay/service.py and docs/protocol.md.
"""
from __future__ import annotations


import trio

from p2pswarm.commands.common import line_buffered_stdout, positive_int


def _nonneg_int(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser("relay", help="run a WebSocket circuit relay (and DHT bootstrap) for NATed workers")
    p.add_argument("--config", help="TOML file with any of the settings below (flags win)")
    p.add_argument("--listen", action="append", default=None,
                   help="multiaddr to listen on, repeatable: /ip4/H/tcp/P/ws (behind a TLS-terminating CDN), "
                        "/ip4/H/tcp/443/wss (with --tls-cert/--tls-key), /ip4/H/tcp/P (default "
                        "/ip4/0.0.0.0/tcp/8080/ws)")
    p.add_argument("--announce", action="append", default=None,
                   help="multiaddr to advertise instead (e.g. /dns4/relay.example.com/tcp/443/wss), repeatable")
    p.add_argument("--identity", help="Ed25519 key file (default $P2PSWARM_HOME/identity/relay.key)")
    p.add_argument("--tls-cert", help="PEM certificate (chain) for /wss listen addresses")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--trust-issuer", action="append", default=None, metavar="PEER_ID",
                   help="grant reservations to holders of relay tokens this issuer signed (repeatable)")
    p.add_argument("--open", action="store_true", default=None, help="no tokens: anyone may reserve")
    p.add_argument("--circuits-need-token", action="store_true", default=None,
                   help="the dialling side of a circuit must have shown a relay token too")
    p.add_argument("--health", metavar="HOST:PORT", help="serve GET /health (JSON) here")
    p.add_argument("--bootstrap", action="append", default=None, help="other DHT bootstrap peers to join")
    p.add_argument("--max-reservations", type=positive_int, help="reserved peers at once (default 1024)")
    p.add_argument("--max-circuits", type=positive_int, help="circuits at once, all peers (default 4096)")
    p.add_argument("--max-circuits-per-peer", type=positive_int,
                   help="circuits to one reserved peer at once (default 256)")
    p.add_argument("--max-circuit-bytes", type=_nonneg_int, help="bytes per circuit, both ways; 0 = unlimited (default)")
    p.add_argument("--max-circuit-duration", type=_nonneg_int, help="seconds per circuit; 0 = unlimited (default)")
    p.add_argument("--reservation-ttl", type=positive_int, help="seconds a reservation lasts unrenewed (default 3600)")
    p.set_defaults(func=run)


def run(args) -> int:
    from p2pswarm.relay.config import load_settings
    from p2pswarm.relay.service import run_relay

    overrides = {k: getattr(args, k) for k in (
        "listen", "announce", "identity", "tls_cert", "tls_key", "trust_issuer", "open", "circuits_need_token",
        "health", "bootstrap", "max_reservations", "max_circuits", "max_circuits_per_peer", "max_circuit_bytes",
        "max_circuit_duration", "reservation_ttl")}
    settings = load_settings(args.config, overrides)
    line_buffered_stdout()
    trio.run(run_relay, settings)
    return 0
