"""`p2pswarm bootstrap --listen /ip4/0.0.0.0/tcp/4001`: a DHT server node others bootstrap from.

It holds no model: it answers Kademlia queries and stores provider and node records, so that new
nodes can find each other. Prints ``READY <multiaddr>`` (the address others pass to --bootstrap).
A host listening on 0.0.0.0 advertises nothing dialable by itself: give --announce with the public
address.
"""
from __future__ import annotations

import logging

import trio

from p2pswarm.commands.common import line_buffered_stdout
from p2pswarm.commands.node import add_net_args, dialable_addrs, listen_addrs
from p2pswarm.lifecycle import until_signal

log = logging.getLogger("p2pswarm.bootstrap")


def add_parser(sub) -> None:
    p = sub.add_parser("bootstrap", help="run a DHT bootstrap node")
    p.add_argument("--bootstrap", action="append", default=[], help="other bootstrap peers to join (repeatable)")
    add_net_args(p, "/ip4/0.0.0.0/tcp/4001")
    p.set_defaults(func=run)


async def _main(args) -> None:
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity

    identity = load_or_create_identity(args.identity or default_identity_path("bootstrap"), exclusive=True)
    async with open_host(identity, listen_addrs(args, "/ip4/0.0.0.0/tcp/4001"), announce=args.announce) as net:
        async with open_dht(net, server=True, bootstrap=args.bootstrap) as dht:
            addrs = dialable_addrs(net)
            log.info("bootstrap node %s up on %s", net.peer_id_str, ", ".join(addrs))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_report, dht)
                await until_signal(nursery.cancel_scope, ready=f"READY {addrs[0]}")


async def _report(dht) -> None:
    """One log line a minute: how many peers the routing table holds."""
    while True:
        await trio.sleep(60)
        log.info("routing table: %d peers", len(dht.routing_peers()))


def run(args) -> int:
    line_buffered_stdout()
    trio.run(_main, args)
    return 0
