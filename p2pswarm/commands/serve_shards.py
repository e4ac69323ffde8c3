"""`p2pswarm serve-shards`: serve a full model's expert slabs on `/p2pswarm/shard/1.0.0` to token holders.

What a backbone runs beside its expert dispatch (it holds every expert); as a command of its own it
is a seed for a model, and what the download tests start. With ``--bootstrap`` it joins the DHT and
provides ``/p2pswarm/source/<fingerprint>`` so `p2pswarm fetch --bootstrap` finds it. Prints
``READY <multiaddr>`` once up; logs one line per refusal (with the reason) and per finished stream.

The download tests inject faults (a throttle, corrupted chunks) through
``tests/helpers/faulty_serve_shards.py``, which calls :func:`run` with the server's fault options;
nothing in this command reads them.
"""
from __future__ import annotations

import logging
from functools import partial

import trio

from p2pswarm.commands.common import line_buffered_stdout


log = logging.getLogger("p2pswarm.serve_shards")


def add_parser(sub) -> None:
    p = sub.add_parser("serve-shards", help="serve a model's expert slabs to token holders (a download source)")
    p.add_argument("--model", required=True, help="the full model GGUF")
    p.add_argument("--manifest", required=True, help="its signed manifest (`p2pswarm manifest`)")
    p.add_argument("--trust-issuer", action="append", required=True, metavar="PEER_ID",
                   help="issuer whose node tokens are honoured (repeatable)")
    p.add_argument("--bootstrap", action="append", default=[], help="join the DHT and provide the source key")
    p.add_argument("--listen", action="append", default=None, help="multiaddr (default /ip4/127.0.0.1/tcp/0)")
    p.add_argument("--announce", action="append", default=None,
                   help="multiaddr to advertise instead of the listen addresses (repeatable; e.g. the CDN's "
                        "/dns4/NAME/tcp/443/wss)")
    p.add_argument("--identity", help="key file (default $P2PSWARM_HOME/identity/backbone.key)")
    p.set_defaults(func=run)


async def _main(args, **server_options) -> None:
    from p2pswarm.commands.node import dialable_addrs
    from p2pswarm.lifecycle import until_signal
    from p2pswarm.model.manifest import read_manifest
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity
    from p2pswarm.net.shards.transfer import run_shard_source
    from p2pswarm.net.signed.tokens import TokenGate

    manifest = read_manifest(args.manifest)
    manifest.verify(trusted_issuers=[manifest.issuer])  # intact (the signature verifies)
    identity = load_or_create_identity(args.identity or default_identity_path("backbone"), exclusive=True)
    gate = TokenGate(args.trust_issuer, what="shard server")
    server = None
    async with open_host(identity, args.listen or ["/ip4/127.0.0.1/tcp/0"], announce=args.announce) as net:
        try:
            async with trio.open_nursery() as nursery:
                dht = await nursery.start(_dht_task, open_dht, net, args.bootstrap) if args.bootstrap else None
                server = await nursery.start(partial(run_shard_source, net, dht, args.model, manifest, gate,
                                                     **server_options))
                await until_signal(nursery.cancel_scope, ready=f"READY {dialable_addrs(net)[0]}")
        finally:
            if server is not None:
                log.info("served %d chunks (%.1f MB) on %d streams; refused %d (%s)", server.stats.chunks,
                         server.stats.bytes / 1e6, server.stats.streams, server.stats.refused,
                         ", ".join(f"{k}: {v}" for k, v in gate.refused.items()) or "none")


async def _dht_task(open_dht, net, bootstrap, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_dht(net, server=True, bootstrap=bootstrap) as dht:
        task_status.started(dht)
        await trio.sleep_forever()


def run(args, **server_options) -> int:
    """``server_options`` go to :class:`~p2pswarm.net.shards.transfer.ShardServer` (fault injection
    in the tests: ``delay_s``, ``corrupt_chunks``)."""
    line_buffered_stdout()
    trio.run(partial(_main, args, **server_options))
    return 0
