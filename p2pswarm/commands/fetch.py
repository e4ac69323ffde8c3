"""`p2pswarm fetch`: download one expert slice of a model from the swarm (see net/shards/transfer.py).

    p2pswarm fetch --model FINGERPRINT --layers A-B --experts C-D --bootstrap ADDR \\
        --token TOKEN_OR_FILE --trust-issuer PEER_ID --out shard.gguf

Sources come from the DHT (``--bootstrap``: peers providing ``/p2pswarm/source/<fingerprint>``) or
are given (``--source``). The token must be held by this node's identity (``--identity``, default
the worker's key, since the worker is who downloads). Interrupted? Run the same command again: it
resumes from ``OUT.part``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import trio

from p2pswarm.commands.common import line_buffered_stdout, positive_int
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.fetch")


def add_parser(sub) -> None:
    p = sub.add_parser("fetch", help="download an expert slice of a model from swarm peers (token needed)")
    p.add_argument("--model", required=True, metavar="FINGERPRINT", help="the model's fingerprint (64 hex digits)")
    p.add_argument("--layers", required=True, help="layer range A-B, inclusive")
    p.add_argument("--experts", required=True, help="expert range C-D, inclusive")
    p.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                   help="find sources through the DHT of this bootstrap peer (repeatable)")
    p.add_argument("--source", action="append", default=[], metavar="ADDR",
                   help="a source's full multiaddr (/ip4/../tcp/../p2p/ID; repeatable)")
    p.add_argument("--token", required=True, metavar="TOKEN_OR_FILE", help="node token allowing this range")
    p.add_argument("--trust-issuer", action="append", required=True, metavar="PEER_ID",
                   help="issuer whose signed manifest is trusted (repeatable)")
    p.add_argument("--out", required=True, metavar="SHARD.gguf",
                   help="where the slice goes (an interrupted run resumes from OUT.part)")
    p.add_argument("--identity", help="this node's key file (default $P2PSWARM_HOME/identity/worker.key; "
                                      "refused while another live process uses it)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="multiaddr to listen on (default %(default)s)")
    p.add_argument("--streams", type=positive_int, default=4, help="parallel streams per source (default 4)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (out, slabs_total, slabs_fetched, slabs_reused, "
                        "bytes_fetched, bad_chunks, seconds, already_complete, refusals) instead of a sentence")
    p.set_defaults(func=run)


def _range(text: str, what: str) -> tuple[int, int]:
    from p2pswarm.model.slicer import parse_range

    return parse_range(text, what)


async def _main(args, token: str, layers, experts) -> None:
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity
    from p2pswarm.net.shards.fetch import FetchStats, fetch_slice
    from p2pswarm.net.shards.transfer import fetch_slice_from_swarm
    from p2pswarm.net.signed.tokens import NodeToken
    from p2pswarm.progress import ProgressBar

    identity = load_or_create_identity(args.identity or default_identity_path("worker"), exclusive=True)
    holder = NodeToken.decode(token).holder
    if holder != identity.peer_id_str:
        raise UserError(f"the token is for peer {holder}, but this node is {identity.peer_id_str} "
                        f"(pass the holder's key with --identity)")
    stats = FetchStats()
    bar = ProgressBar("fetch", unit="B")
    async with open_host(identity, [args.listen]) as net:
        try:
            if args.bootstrap:
                async with open_dht(net, server=False, bootstrap=args.bootstrap) as dht:
                    out = await fetch_slice_from_swarm(net, dht, model=args.model, layers=layers, experts=experts,
                                                       out_path=args.out, token=token,
                                                       trusted_issuers=args.trust_issuer, extra_sources=args.source,
                                                       progress=bar.update, stats=stats)
            else:
                out = await fetch_slice(net, sources=args.source, model=args.model, layers=layers, experts=experts,
                                        out_path=args.out, token=token, trusted_issuers=args.trust_issuer,
                                        progress=bar.update, stats=stats, streams_per_source=args.streams)
        finally:
            bar.close()
    if args.json:  # for scripts and the tests: the numbers, not a sentence to parse
        print(json.dumps({"out": str(out), **dataclasses.asdict(stats)}))
        return
    if stats.already_complete:
        print(f"{out}: already complete and verified; nothing fetched")
        return
    rate = stats.bytes_fetched / max(stats.seconds, 1e-9) / 1e6
    print(f"wrote {out}: {stats.slabs_total} slabs, {stats.slabs_fetched} fetched ({stats.bytes_fetched / 1e6:.1f} MB, "
          f"{rate:.1f} MB/s), {stats.slabs_reused} reused from an interrupted run, {stats.bad_chunks} bad chunks "
          f"fetched again")


def run(args) -> int:
    from p2pswarm.net.signed.tokens import load_token

    if not re.fullmatch(r"[0-9a-fA-F]{64}", args.model):
        raise UserError(f"--model {args.model[:70]!r} is not a model fingerprint (64 hex digits; "
                        f"`p2pswarm manifest` and `swarm-status` print it)")
    if not args.bootstrap and not args.source:
        raise UserError("give --bootstrap ADDR (find sources through the DHT) or --source ADDR")
    experts = _range(args.experts, "expert")
    layers = _range(args.layers, "layer")
    token = load_token(args.token)
    line_buffered_stdout()
    trio.run(_main, args, token, layers, experts)
    return 0
