"""`p2pswarm node --role worker|backbone`: a swarm node on libp2p. No coordinator.

* worker: serves its shard on `/p2pswarm/expert/1.0.0`, provides a signed DHT record for every
  coverage unit it holds (re-provided before expiry, withdrawn on a clean shutdown).
* backbone: holds the dense path and every expert as fallback, finds owners and replicas through DHT
  look-ups, and serves generation over a local OpenAI-style HTTP endpoint (`/v1/completions`).

Both print ``READY <multiaddr>`` on stdout once up, log one line per significant event, and shut
down cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import logging
import signal
import sys

import trio

from p2pswarm.net.records import DEFAULT_BLOCK_SIZE
from p2pswarm.commands.common import add_kernel_args
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.node")


def add_net_args(p, default_listen: str = "/ip4/127.0.0.1/tcp/0") -> None:
    """--listen / --announce / --identity, shared by node and bootstrap."""
    p.add_argument("--listen", action="append", default=None,
                   help=f"multiaddr to listen on (repeatable; default {default_listen})")
    p.add_argument("--announce", action="append", default=None,
                   help="multiaddr to advertise instead of the listen addresses (repeatable)")
    p.add_argument("--identity", help="Ed25519 key file (created mode 0600 on first start; "
                                      "default $P2PSWARM_HOME/identity/<role>.key)")


def listen_addrs(args, default: str) -> list[str]:
    return args.listen or [default]


def add_parser(sub) -> None:
    p = sub.add_parser("node", help="run a swarm node: an expert worker or a backbone")
    p.add_argument("--role", required=True, choices=("worker", "backbone"))
    p.add_argument("--bootstrap", action="append", default=[], help="bootstrap peer multiaddr (repeatable)")
    p.add_argument("--shard", help="worker: expert shard GGUF cut by `p2pswarm slice`")
    p.add_argument("--model", help="backbone: the full model GGUF")
    p.add_argument("--http", default="127.0.0.1:8000", help="backbone: HOST:PORT of the HTTP endpoint "
                                                          "(port 0 picks one; 'off' disables it)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"experts per coverage unit; the same swarm-wide (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--ttl", type=float, default=600.0, help="worker: record lifetime in seconds (default 600)")
    p.add_argument("--timeout", type=float, default=30.0, help="backbone: seconds to wait for a worker")
    add_net_args(p)
    add_kernel_args(p)
    p.set_defaults(func=run)


async def _until_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("signal %s: shutting down", signal.Signals(sig).name)
            cancel_scope.cancel()
            return


async def _worker(args) -> None:
    from p2pswarm.net import expert_protocol as proto
    from p2pswarm.net.dht import ShardAdvertiser, open_dht
    from p2pswarm.net.host import open_host
    from p2pswarm.net.identity import default_identity_path, load_or_create_identity
    from p2pswarm.net.records import ShardEntry, worker_shard_hash
    from p2pswarm.worker.expert_worker import ExpertWorker
    from p2pswarm.worker.server import serve_libp2p

    worker = ExpertWorker(args.shard, kernel=args.kernel, threads=args.threads)
    info = worker.info
    identity = load_or_create_identity(args.identity or default_identity_path("worker"))
    entry = ShardEntry(info.model_fingerprint, worker_shard_hash(worker), (info.layer_begin, info.layer_end),
                       (info.expert_begin, info.expert_end))
    async with open_host(identity, listen_addrs(args, "/ip4/127.0.0.1/tcp/0"), announce=args.announce) as net:
        async with open_dht(net, server=True, bootstrap=args.bootstrap) as dht:
            log.info("joined the swarm as %s (%d bootstrap peers)", net.peer_id_str, len(args.bootstrap))
            serve_libp2p(net, worker)
            adv = ShardAdvertiser(dht, identity, shards=[entry], protocol=proto.PROTOCOL_VERSION,
                                  kernel=info.kernel, block_size=args.block_size, ttl_s=args.ttl)
            async with trio.open_nursery() as nursery:
                await nursery.start(adv.run)
                log.info("serving %s with kernel %s", info.describe(), info.kernel)
                print(f"READY {net.full_addrs()[0]}", flush=True)
                await _until_signal(nursery.cancel_scope)
            with trio.CancelScope(shield=True):
                await adv.withdraw()
            log.info("withdrew my records; bye")


async def _backbone(args) -> None:
    from p2pswarm.backbone.http_api import CompletionsApp, serve_http
    from p2pswarm.backbone.swarm_session import open_swarm_backbone
    from p2pswarm.engine.tokenizer import Tokenizer
    from p2pswarm.net.identity import default_identity_path, load_or_create_identity

    identity = load_or_create_identity(args.identity or default_identity_path("backbone"))
    tokenizer = Tokenizer.from_gguf(args.model)
    async with open_swarm_backbone(args.model, bootstrap=args.bootstrap, identity=identity,
                                   listen=listen_addrs(args, "/ip4/127.0.0.1/tcp/0"), block_size=args.block_size,
                                   kernel=args.kernel, threads=args.threads, timeout_s=args.timeout) as swarm:
        log.info("joined the swarm as %s", swarm.net.peer_id_str)
        async with trio.open_nursery() as nursery:
            http = "off"
            if args.http != "off":
                host, _, port = args.http.rpartition(":")
                if not host or not port.isdigit():
                    raise UserError(f"bad --http {args.http!r}: expected HOST:PORT or off")
                app = CompletionsApp(swarm.backbone, tokenizer, args.model, swarm.local.fingerprint)
                binds = await nursery.start(serve_http, app, host, int(port))
                http = binds[0]
                log.info("serving /v1/completions on %s", http)
            print(f"READY {swarm.net.full_addrs()[0]} http={http}", flush=True)
            await _until_signal(nursery.cancel_scope)


def run(args) -> int:
    if args.role == "worker" and not args.shard:
        raise UserError("--role worker needs --shard SHARD.gguf")
    if args.role == "backbone" and not args.model:
        raise UserError("--role backbone needs --model MODEL.gguf")
    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    sys.stdout.reconfigure(line_buffering=True)
    trio.run(_worker if args.role == "worker" else _backbone, args)
    return 0
