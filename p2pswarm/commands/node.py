"""`p2pswarm node --role worker|backbone`: a swarm node on libp2p. No coordinator.

* worker: serves its shard on `/p2pswarm/expert/1.0.0`, provides a signed DHT record for every
  coverage unit it holds (re-provided before expiry, withdrawn on a clean shutdown). With
  ``--auto --memory SIZE`` it picks its units itself from the backbones' demand records and the
  coverage in the DHT, downloads only those, and re-evaluates every ``--enrol-period``
  (docs/market.md).
* backbone: holds the dense path and every expert as fallback, finds owners and replicas through DHT
  look-ups, and serves the OpenAI API (`/v1/chat/completions`, `/v1/completions`), a status page and
  `/metrics` over local HTTP (docs/api.md).

Both print ``READY <multiaddr>`` on stdout once up, log one line per significant event, and shut
down cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pswarm import settings
from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE, DEFAULT_RECORD_TTL_S
from p2pswarm.net.signed.tokens import AUTO_SCOPE
from p2pswarm.commands.common import (add_expert_cache_arg, add_kernel_args, add_market_args, add_speculate_args,
                                      expert_cache_size, market_kwargs, parse_hostport, positive_int,
                                      line_buffered_stdout, require_backbone_model, speculation_from)
from p2pswarm.commands.node_downloads import _fetch_backbone, _fetch_shard, _serve_own_shard
from p2pswarm.commands.node_args import (add_http_limit_args, add_worker_limit_args, check_dht_mode,
                                         check_worker_source, http_limits, peer_budget)
from p2pswarm.errors import UserError
from p2pswarm.http_server import bind_http
from p2pswarm.lifecycle import until_signal
from p2pswarm.market.last_receipt import collect_last_receipts
from p2pswarm.worker.health import add_health_arg

if TYPE_CHECKING:  # loaded when a worker starts, not with the CLI
    from p2pswarm.net.signed.records import ShardEntry
    from p2pswarm.worker.expert_worker import ExpertWorker, ShardInfo

log = logging.getLogger("p2pswarm.node")


def add_net_args(p, default_listen: str = "/ip4/127.0.0.1/tcp/0") -> None:
    """--listen / --announce / --identity, shared by node and bootstrap."""
    p.add_argument("--listen", action="append", default=None,
                   help=f"multiaddr to listen on (repeatable; default {default_listen})")
    p.add_argument("--announce", action="append", default=None,
                   help="multiaddr to advertise instead of the listen addresses (repeatable)")
    p.add_argument("--identity", help="Ed25519 key file (created mode 0600 on first start; "
                                      "default $P2PSWARM_HOME/identity/<role>.key); one live node per key: "
                                      "a second process on a key in use is refused")


def dialable_addrs(net) -> list[str]:
    """Our full addresses for the READY line and logs. A node listening on 0.0.0.0 without
    --announce advertises nothing (we never guess a public address for the DHT), but the operator
    still needs an address to hand out: this host's primary IPv4 address, with a hint."""
    addrs = net.full_addrs()
    if addrs:
        return addrs
    import socket

    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    out = [f"{str(a).replace('/ip4/0.0.0.0/', f'/ip4/{ip}/')}/p2p/{net.peer_id_str}" for a in net.transport_addrs()]
    log.info("listening on a wildcard address only: others on this network can dial %s; use --announce to "
             "advertise a public address", out[0])
    return out


def listen_addrs(args, default: str) -> list[str]:
    return args.listen or [default]


def _auto_or_positive(text: str):
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except Exception:  # argparse's error, with our wording
        import argparse

        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("node", help="run a swarm node: an expert worker or a backbone")
    p.add_argument("--role", required=True, choices=("worker", "backbone"),
                   help="worker: serve one expert shard; backbone: the dense path, every expert as fallback, "
                        "and the HTTP endpoint")
    p.add_argument("--bootstrap", action="append", default=[], help="bootstrap peer multiaddr (repeatable)")
    p.add_argument("--shard", help="worker: expert shard GGUF cut by `p2pswarm slice` (with --model "
                                   "FINGERPRINT: where the downloaded slice goes)")
    p.add_argument("--model", help="backbone: the full model GGUF, or the backbone file (`slice --backbone`: "
                                   "no routed experts; see --expert-cache), or a model FINGERPRINT whose backbone "
                                   "slice it downloads from the swarm's shard sources (with --token and "
                                   "--trust-issuer; --shard: where it goes); worker without a shard file: the model "
                                   "FINGERPRINT whose slice (--layers, --experts) it downloads from the swarm")
    p.add_argument("--layers", help="worker download: layer range A-B (inclusive)")
    p.add_argument("--experts", help="worker download: expert range C-D (inclusive)")
    p.add_argument("--trust-issuer", action="append", default=[], metavar="PEER_ID",
                   help="worker download: issuer whose signed manifest is trusted; backbone: issuer whose "
                        "tokens may download shards (with --manifest), or whose signed manifest the expert cache's "
                        "fetched slabs are checked against (with --token) (repeatable)")
    p.add_argument("--manifest", help="backbone: the model's signed manifest (`p2pswarm manifest`): serve "
                                      "shard downloads to token holders")
    p.add_argument("--http", default="127.0.0.1:8000", help="backbone: HOST:PORT of the HTTP endpoint, checked "
                                                          "before joining (default 127.0.0.1:8000; port 0 picks "
                                                          "one; 'off' disables it): the OpenAI API, the status "
                                                          "page at /, /metrics (docs/api.md)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="backbone: the model id the OpenAI API answers to (default: the GGUF's file name "
                        "without .gguf, and a split model's without -00001-of-0000N); requests naming "
                        "another model get a 404")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"experts per coverage unit; the same swarm-wide (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--ttl", type=float, default=DEFAULT_RECORD_TTL_S,
                   help="worker: lifetime in seconds of its signed DHT record, re-published every third of it; "
                        f"killed, it drops out of look-ups within one TTL (default {DEFAULT_RECORD_TTL_S:.0f})")
    p.add_argument("--timeout", type=float, default=30.0, help="backbone: seconds to wait for a worker")
    p.add_argument("--demand-ttl", type=float, default=None, metavar="SECONDS",
                   help="backbone: lifetime of its signed demand record in the DHT, re-published every third of it "
                        "(default 120; docs/market.md)")
    p.add_argument("--token-budget", type=_auto_or_positive, default="auto",
                   help="backbone: rows per batched step, decode rows first, then prefill chunks; 'auto' "
                        "(default): 256, grown while a step waits on the network longer than it computes "
                        "(docs/architecture.md)")
    p.add_argument("--prefill-chunk", type=positive_int, default=32,
                   help="backbone: a prompt is fed in chunks of this many tokens (default 32)")
    p.add_argument("--max-active", type=positive_int, default=256,
                   help="backbone: sequences decoded together; more requests wait (default 256)")
    p.add_argument("--micro-batches", type=_auto_or_positive, default="auto",
                   help="backbone: split each step into this many concurrently dispatched micro-batches, or "
                        "'auto' (from measured dense time and round trip; docs/architecture.md)")
    add_speculate_args(p, "backbone: ")
    p.add_argument("--direct", metavar="HOST:PORT", default=None,
                   help="worker: also serve expert requests on this TCP address, a direct lane that backbones "
                        "key through the authenticated libp2p stream (sealed ChaCha20-Poly1305; about half the CPU per "
                        "request than py-libp2p; port 0 picks one; docs/protocol.md)")
    p.add_argument("--direct-announce", metavar="HOST:PORT", default=None,
                   help="worker: the address backbones dial for the direct lane (a proxy, a port forward); "
                        "default: the --direct port on the address they reached us at")
    p.add_argument("--no-direct", dest="use_direct", action="store_false",
                   help="backbone: keep every worker's requests on libp2p, even where it offers a direct lane")
    p.add_argument("--hot-experts", action="store_const", const=True, default=None,
                   help="backbone: compute an owner's experts locally when its measured round trip is longer "
                        "than computing them here (same bits; an owner kept local is probed in the background "
                        "every 2 s to measure it again; docs/architecture.md). Default: on for a backbone whose "
                        "--expert-cache is below all (only for owners whose experts are all cached), else off")
    p.add_argument("--no-hot-experts", dest="hot_experts", action="store_const", const=False,
                   help="backbone: never keep an owner's experts local (see --hot-experts)")
    p.add_argument("--wire-precision", choices=("f32", "f16", "bf16"), default="f32",
                   help="backbone: round every routed expert's output to 16 bits, whoever computes it (workers "
                        "then send half the bytes; a backbone alone with the same setting gives the same bits; "
                        "off by default: f32; the distance to llama.cpp is in docs/benchmarks.md)")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="backbone: batch rows of all sequences through one dense/router/expert/lm-head mat-mul "
                        "even where a probe found the kernel not row-invariant (a request's tokens may then "
                        "depend on its neighbours, docs/architecture.md)")
    p.add_argument("--relay", metavar="MULTIADDR", action="append", default=[],
                   help="worker behind NAT: keep a reservation on a relay (/ip4/H/tcp/P/ws/p2p/ID or .../wss/...), "
                        "use it as DHT bootstrap, and advertise the relayed address (a DHT client, not a server). "
                        "Repeatable: one of them is picked at random, and the worker moves to another (or to one "
                        "found in the DHT) when its relay dies or is full. `--relay auto`: find relays through "
                        "--bootstrap in the DHT")
    p.add_argument("--token", help="worker: node token (or a file holding it) to show the relay "
                                   "(`p2pswarm token issue --allow relay`) and/or the shard sources "
                                   "(--allow shard...); backbone: the token its expert cache shows the shard "
                                   "sources it fetches slabs from (--allow shard:FINGERPRINT)")
    p.add_argument("--auto", action="store_true",
                   help="worker: enrol by itself - read demand and coverage from the DHT, hold the highest-reward "
                        "units that fit --memory, download only them (needs --trust-issuer and --token, issued "
                        f"with {AUTO_SCOPE}), re-evaluate every --enrol-period (docs/market.md); --model "
                        "FINGERPRINT picks the model when backbones serve several")
    p.add_argument("--memory", metavar="SIZE",
                   help="worker --auto: bytes of expert weights it may hold, e.g. 340MB, 1.5GB, 512MiB")
    p.add_argument("--dht", choices=("server", "client"), default=None, dest="dht_mode",
                   help="worker: serve the Kademlia DHT (answer other peers' queries, store their records) or "
                        "only use it (put our records, look others up). Default: client for --auto and --relay "
                        "workers (a phone should not carry the DHT's load; bootstrap and backbone nodes serve it), "
                        "server otherwise. --relay needs client: nobody can dial a NATed worker's kad")
    p.add_argument("--enrol-period", type=float, default=60.0, metavar="SECONDS",
                   help="worker --auto: seconds between re-evaluations, jittered +-25%% (default 60)")
    p.add_argument("--receipts-dir", metavar="DIR",
                   help="worker: keep the contribution receipts backbones sign here (default "
                        "$P2PSWARM_HOME/receipts/<peer id>; `p2pswarm rewards` lists them)")
    add_health_arg(p)
    p.add_argument("--drain-s", type=float, default=10.0, metavar="SECONDS",
                   help="backbone: on SIGINT/SIGTERM, seconds running requests get to finish before they are cut "
                        "with an error (new ones get 503 at once; a second signal cuts at once; exit status 1 when "
                        "requests were cut) (default 10)")
    add_http_limit_args(p)
    add_worker_limit_args(p)
    add_market_args(p, "backbone: ")
    add_expert_cache_arg(p, "backbone: ")
    p.add_argument("--cache-refill", type=float, default=30.0, metavar="SECONDS",
                   help="backbone with --expert-cache below all: move the cache to the hottest experts by measured "
                        "demand this often (fetched from the swarm for a backbone file; default 30)")
    add_net_args(p)
    add_kernel_args(p)
    p.set_defaults(func=run)


async def _worker(args) -> None:
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.dht.advertiser import ShardAdvertiser
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.market.receipts import ReceiptStore, default_receipts_dir
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity
    from p2pswarm.worker.server import ServeStats, serve_libp2p

    identity = load_or_create_identity(args.identity or default_identity_path("worker"), exclusive=True)
    # (worker, its info, its DHT entry): a local --shard now (a bad file fails before any network);
    # --fetch: once the slice is downloaded; --auto: the market picks, per slice
    loaded = None if args.fetch or args.auto else _load_shard(args.shard, args)
    keeper = None
    relayed = bool(args.relay) or getattr(args, "relay_auto", False)
    dht_of: list = []  # the keeper looks relays up in the DHT once there is one
    async with open_host(identity, listen_addrs(args, "/ip4/127.0.0.1/tcp/0"), announce=args.announce) as net:
        if args.relay:  # a given relay is also the way into the DHT: reserve first
            keeper = await _start_relay_keeper(args, net, dht_of)
        bootstrap = [*args.bootstrap, *([keeper.relay_addr] if keeper else [])]
        # Behind NAT nobody can dial us except through the relay: a DHT client, not a server. An
        # --auto worker is one too by default (args.dht_mode, resolved in run()).
        async with open_dht(net, server=args.dht_mode == "server", bootstrap=bootstrap) as dht:
            dht_of.append(dht)
            if relayed and keeper is None:  # --relay auto: find one in the DHT
                keeper = await _start_relay_keeper(args, net, dht_of)
            if bootstrap or relayed:
                log.info("joined the swarm as %s (%d bootstrap peers%s)", net.peer_id_str, len(bootstrap),
                         f", relayed, DHT client, through relay {keeper.relay_id.to_base58()}" if keeper is not None
                         else f", DHT {args.dht_mode}")
            else:
                log.warning("no --bootstrap and no --relay: this worker (%s) runs isolated, in no swarm, and no "
                            "backbone will find its experts unless it bootstraps from this worker's own address; "
                            "pass --bootstrap MULTIADDR (a bootstrap node's READY address) or --relay MULTIADDR",
                            net.peer_id_str)
            if args.auto:
                await _auto_worker(args, net, dht, identity, keeper)
                return
            if loaded is None:  # --fetch
                shard = await _fetch_shard(args, net, dht, identity)
                loaded = await trio.to_thread.run_sync(_load_shard, shard, args)
                _serve_own_shard(net, shard, args)
            else:  # a local shard file: served onwards where a `.source` sidecar says what it is
                _serve_own_shard(net, Path(args.shard), args, fingerprint=loaded[1].model_fingerprint)
            worker, info, entry = loaded
            served = ServeStats()
            receipts = ReceiptStore(args.receipts_dir or default_receipts_dir() / identity.peer_id_str,
                                    identity.peer_id_str)
            lane = args.direct_lane
            serve_libp2p(net, worker, stats=served, receipts=receipts, direct=lane, budget=args.peer_budget)
            adv = ShardAdvertiser(dht, identity, shards=[entry], protocol=proto.PROTOCOL_VERSION,
                                  kernel=info.kernel, block_size=args.block_size, ttl_s=args.ttl)
            async with trio.open_nursery() as nursery:
                if keeper is not None:
                    async def rejoin() -> None:
                        # A restarted relay lost the records it stored: bootstrap and publish again.
                        await dht.bootstrap([keeper.relay_addr])
                        await adv.publish()
                        log.info("re-published my records through the relay")

                    keeper.on_reserved = rejoin
                    nursery.start_soon(keeper.keep)
                if lane is not None:
                    await _start_direct(nursery, lane)
                await nursery.start(adv.run)
                log.info("serving %s with kernel %s", info.describe(), info.kernel)
                ready = await _ready_line(args, nursery, net, served, lambda: [info.describe()], dht)
                await until_signal(nursery.cancel_scope, ready=ready)
            with trio.CancelScope(shield=True):
                await adv.withdraw()
                await collect_last_receipts(net, sorted(served.peers), receipts)
            log.info("served %d expert requests (%d rows) for %d peers; refused %d handshakes; stored %d receipts "
                     "in %s", served.requests, served.rows, len(served.peers), served.refused, receipts.stored,
                     receipts.dir)
            log.info("wire: received %d bytes, sent %d bytes", served.wire.received, served.wire.sent)
            log.info("computed %d requests inline on the event loop and %d in a thread (P2PSWARM_INLINE_MS %g)",
                     worker.offload.inline_calls, worker.offload.thread_calls, 1000 * worker.offload.inline_s)
            log.info("withdrew my records; bye")


def _check_own_token(args) -> None:
    """A downloading worker's token that no source could accept: refused now, in one line, before
    anything is logged (the key is read, not locked or created, to learn this node's id)."""
    from p2pswarm.net.signed.identity import default_identity_path, load_identity
    from p2pswarm.net.signed.tokens import NodeToken, check_own_token, shard_scope

    if not (args.auto or args.fetch):
        return
    path = Path(args.identity or default_identity_path("worker"))
    if not path.exists():
        raise UserError(f"--token was issued to peer {NodeToken.decode(args.node_token).holder}, but identity key "
                        f"{path} does not exist yet (a new key is a new peer id): start with --identity KEY, the "
                        "key the token was issued to")
    peer = load_identity(path).peer_id_str
    if args.auto:
        check_own_token(args.node_token, peer=peer, trusted_issuers=args.trust_issuer, model=args.model)
    elif args.fetch:
        check_own_token(args.node_token, peer=peer, trusted_issuers=args.trust_issuer,
                        scope=shard_scope(args.model, args.layer_range, args.expert_range))


def _direct_lane(args):
    """The worker's direct lane from ``--direct`` / ``--direct-announce``, or None."""
    from p2pswarm.net.wire.direct import DirectLane
    from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME

    if args.direct is None:
        if args.direct_announce is not None:
            raise UserError("--direct-announce needs --direct HOST:PORT (the address to listen on)")
        return None
    host, port = parse_hostport(args.direct, "--direct")
    lane = DirectLane(host, port, max_frame=DEFAULT_MAX_FRAME)
    if args.direct_announce is not None:
        lane.announce_host, lane.announce_port = parse_hostport(args.direct_announce, "--direct-announce")
        if lane.announce_port == 0:
            raise UserError("--direct-announce needs a real port, not 0")
    return lane


async def _start_direct(nursery, lane) -> None:
    host, port = await nursery.start(lane.serve)
    log.info("direct lane listening on %s:%d%s", host, port,
             f", announced as {lane.announce_host or '<our address>'}:{lane.announce_port}" if lane.announce_port
             else "")


async def _auto_worker(args, net, dht, identity, keeper) -> None:
    """The ``--auto`` worker inside its host and DHT: enrol, serve, re-evaluate until a signal."""
    from p2pswarm.engine.kernels import kernel_id
    from p2pswarm.market.auto import AutoWorker
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.worker.server import ServeStats, serve_libp2p_shards

    from p2pswarm.market.receipts import ReceiptStore, default_receipts_dir

    home = settings.home_dir()
    from p2pswarm.net.shards.server import ShardFiles
    from p2pswarm.net.signed.tokens import TokenGate

    auto = AutoWorker(net, dht, identity, memory=args.memory_bytes, token=args.node_token,
                      trusted_issuers=args.trust_issuer, load_shard=lambda path: _load_shard(path, args),
                      kernel=kernel_id(args.kernel), protocol=proto.PROTOCOL_VERSION, home=home,
                      model=args.model, ttl_s=args.ttl, period_s=args.enrol_period,
                      shard_files=ShardFiles(net, TokenGate(args.trust_issuer, what="shard server")))
    served = ServeStats()
    receipts = ReceiptStore(args.receipts_dir or default_receipts_dir() / identity.peer_id_str, identity.peer_id_str)
    lane = args.direct_lane
    serve_libp2p_shards(net, auto.shards, stats=served, receipts=receipts, direct=lane, budget=args.peer_budget)
    async with trio.open_nursery() as nursery:
        # SIGTERM/SIGINT stop it cleanly from now on: enrolment can wait long (no shard source yet)
        await nursery.start(until_signal, nursery.cancel_scope)
        if lane is not None:
            await _start_direct(nursery, lane)
        if keeper is not None:
            async def rejoin() -> None:
                await dht.bootstrap([keeper.relay_addr])
                if auto.advertiser is not None:
                    await auto.advertiser.publish()
                log.info("re-published my records through the relay")

            keeper.on_reserved = rejoin
            nursery.start_soon(keeper.keep)
        await nursery.start(auto.run)
        print(await _ready_line(args, nursery, net, served, lambda: auto.describe().split(", "), dht), flush=True)
    with trio.CancelScope(shield=True):
        await auto.withdraw()
        await collect_last_receipts(net, sorted(served.peers), receipts)
    log.info("served %d expert requests (%d rows) for %d peers in %d evaluations; stored %d receipts in %s; "
             "withdrew my records; bye", served.requests, served.rows, len(served.peers), auto.evaluations,
             receipts.stored, receipts.dir)
    log.info("wire: received %d bytes, sent %d bytes", served.wire.received, served.wire.sent)


async def _ready_line(args, nursery, net, served, shards, dht=None) -> str:
    """A worker's READY line; with --health, its /health served first and named in it."""
    from p2pswarm.worker.health import start_health, worker_health

    line = f"READY {dialable_addrs(net)[0]}"
    if args.health_socket is None:
        return line
    url = await start_health(nursery, args.health_socket,
                             lambda: worker_health(net.peer_id_str, served, shards(), dht))
    return f"{line} health={url}"


async def _serve_shards(args, swarm, nursery) -> None:
    """Serve `/p2pswarm/shard/1.0.0` from the full model to holders of tokens by a trusted issuer
    (default: the manifest's own issuer), and provide the model's source key in the DHT."""
    from p2pswarm.model.manifest import read_manifest
    from p2pswarm.net.shards.transfer import run_shard_source
    from p2pswarm.net.signed.tokens import TokenGate

    manifest = read_manifest(args.manifest)
    trusted = args.trust_issuer or [manifest.issuer]
    manifest.verify(trusted_issuers=trusted, fingerprint=swarm.local.fingerprint)
    gate = TokenGate(trusted, what="shard server")
    await nursery.start(run_shard_source, swarm.net, swarm.resolver.dht, args.model, manifest, gate)
    if swarm.demand is not None:  # `--auto` workers download from the backbones their demand records name
        swarm.demand.serves_shards = True
        await swarm.demand.publish()
    log.info("serving shard downloads of model %s to holders of tokens issued by %s", swarm.local.fingerprint,
             ", ".join(trusted))


def _load_shard(path, args) -> tuple[ExpertWorker, ShardInfo, ShardEntry]:
    from p2pswarm.net.signed.records import ShardEntry
    from p2pswarm.worker.expert_worker import ExpertWorker, worker_shard_hash

    worker = ExpertWorker(path, kernel=args.kernel, threads=args.threads)
    info = worker.info
    entry = ShardEntry(info.model_fingerprint, worker_shard_hash(worker), (info.layer_begin, info.layer_end),
                       (info.expert_begin, info.expert_end))
    return worker, info, entry


async def _start_relay_keeper(args, net, dht_of: list):
    """Reserve on one of ``--relay`` (or a relay found in the DHT) now (one-line error if none takes
    us); returns the keeper, whose ``keep()`` then holds the reservation (renewals, reconnects after a
    relay restart, a move to another relay when this one is gone)."""
    from p2pswarm.net.libp2p.relay_client import RelayKeeper
    from p2pswarm.net.libp2p.relay_discovery import find_relays

    async def discover(exclude: set[str]) -> list[str]:
        return await find_relays(dht_of[0], exclude=exclude) if dht_of else []

    keeper = RelayKeeper(net, args.relay, args.relay_token, relay_only=not args.announce, discover=discover)
    await keeper.start()
    return keeper


async def _backbone(args) -> None:
    from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
    from p2pswarm.backbone.serving.scheduler import Scheduler
    from p2pswarm.backbone.api.status_page import SwarmView
    from p2pswarm.backbone.sessions.swarm import open_swarm_backbone
    from p2pswarm.engine.text.tokenizer import Tokenizer
    from p2pswarm.model.split_gguf import model_name
    from p2pswarm.net.signed.identity import default_identity_path, load_or_create_identity

    identity = load_or_create_identity(args.identity or default_identity_path("backbone"), exclusive=True)
    if args.backbone_download:
        args.model = str(await _fetch_backbone(args, identity))
        require_backbone_model(args.model)
    speculate = speculation_from(args, args.model)  # (a mode the file cannot run: refused before anything starts)
    tokenizer = Tokenizer.from_gguf(args.model)
    async with open_swarm_backbone(args.model, bootstrap=args.bootstrap, identity=identity,
                                   listen=listen_addrs(args, "/ip4/127.0.0.1/tcp/0"), announce=args.announce,
                                   block_size=args.block_size,
                                   kernel=args.kernel, threads=args.threads, timeout_s=args.timeout,
                                   demand_ttl_s=args.demand_ttl, direct=args.use_direct,
                                   hot_experts=args.hot_experts if args.http_socket is not None else False,
                                   expert_cache=args.expert_cache_size, shard_token=args.backbone_token,
                                   trust_issuers=args.trust_issuer, cache_refill_s=args.cache_refill,
                                   **market_kwargs(args)) as swarm:
        # Whole fingerprint and kernel id: what workers (--model) and swarm-status (--kernel) need.
        log.info("joined the swarm as %s, serving model %s with kernel %s", swarm.net.peer_id_str,
                 swarm.local.fingerprint, swarm.resolver.kernel)
        swarm.backbone.dispatcher.set_wire_precision(None if args.wire_precision == "f32" else args.wire_precision)
        async with trio.open_nursery() as nursery:
            http, app = "off", None
            if args.http_socket is not None:
                swarm.backbone.batch_invariant = args.batch_invariant
                scheduler = Scheduler(swarm.backbone, tokenizer, token_budget=args.token_budget,
                                      prefill_chunk=args.prefill_chunk, max_active=args.max_active,
                                      micro_batches=args.micro_batches, speculate=speculate)
                view = SwarmView.for_backbone(swarm.backbone, swarm.local.layout,
                                              block_size=swarm.resolver.block_size, resolver=swarm.resolver)
                app = CompletionsApp(swarm.backbone, tokenizer, args.served_model_name or model_name(args.model),
                                     swarm.local.fingerprint, model_path=args.model, view=view, scheduler=scheduler,
                                     limits=args.http_limits,
                                     extra_health=lambda: {"dht_records": swarm.resolver.dht.records_held()})
                swarm.pool.on_latency = app.metrics.observe_owner
                binds = await nursery.start(serve_http, app, args.http_socket)
                http = binds[0]
                log.info("serving the OpenAI API (model %r) and the status page on %s%s", app.model_name, http,
                         "" if app.chat else "; no chat template: /v1/chat/completions refuses")
            if args.manifest:
                await _serve_shards(args, swarm, nursery)
            await until_signal(trio.CancelScope(), ready=f"READY {dialable_addrs(swarm.net)[0]} http={http}")
            if app is not None:  # running requests finish, or are cut with an error (http_api.py)
                args.cut = await app.drain(args.drain_s)
            nursery.cancel_scope.cancel()


def run(args) -> int:
    args.fetch = False
    args.backbone_download = False
    args.node_token = None
    args.http_socket = args.health_socket = None
    from p2pswarm.net.wire.direct import local_aeads
    local_aeads()  # a bad P2PSWARM_DIRECT_AEAD: one line now, not at the first direct lane
    if args.role == "worker":
        args.peer_budget = peer_budget(args)
        args.health_socket = bind_http(args.health, "--health") if args.health else None
        check_worker_source(args)
        _check_own_token(args)
        args.direct_lane = _direct_lane(args)  # a malformed --direct or a taken port: one line now
        if args.direct_lane is not None:
            args.direct_lane.bind()
    elif args.auto or args.health:
        raise UserError(f"{'--auto' if args.auto else '--health'} is for --role worker (a backbone's /health is on "
                        "--http)")
    elif args.direct is not None or args.direct_announce is not None:
        raise UserError("--direct is for --role worker (a backbone takes the lanes workers offer; --no-direct: never)")
    check_dht_mode(args)
    if args.role == "backbone" and not args.model:
        raise UserError("--role backbone needs --model MODEL.gguf")
    if not args.drain_s >= 0:
        raise UserError("--drain-s must be >= 0 seconds")
    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    if args.demand_ttl is not None and not args.demand_ttl >= 3:
        raise UserError("--demand-ttl must be at least 3 seconds")
    if args.expert_cache is not None and args.role != "backbone":
        raise UserError("--expert-cache is for --role backbone (a worker holds its shard)")
    if args.role == "backbone":
        from p2pswarm.model.layout import ModelLayout

        args.backbone_download = bool(re.fullmatch(r"[0-9a-fA-F]{64}", args.model)) and not Path(args.model).exists()
        if args.backbone_download:
            if not (args.token and args.trust_issuer and args.bootstrap):
                raise UserError("--model FINGERPRINT on a backbone downloads its backbone slice from the swarm: give "
                                "--token (issued with --allow shard:FINGERPRINT), --trust-issuer and --bootstrap")
            if args.manifest:
                raise UserError("--manifest serves shard downloads from the full model; a downloaded backbone slice "
                                "holds no experts to serve")
        else:
            require_backbone_model(args.model)
        args.expert_cache_size = expert_cache_size(args)  # a bad value: one line now
        settings.WIRE_CODEC_FAST_MBPS.get()  # read per request later: a bad value is one line now, not mid-run
        args.backbone_token = None
        if not args.cache_refill > 0:
            raise UserError("--cache-refill must be > 0 seconds")
        if args.token:  # a backbone file's cache is filled from the swarm's shard sources with it
            from p2pswarm.net.signed.tokens import load_token

            args.backbone_token = load_token(args.token)
            if not args.trust_issuer:
                raise UserError("--token on a backbone fetches experts into its cache: give --trust-issuer PEER_ID, "
                                "the issuer whose signed manifest the slabs are checked against")
        if args.manifest and not args.backbone_download and ModelLayout.open(args.model).shard_kind == "backbone":
            raise UserError("--manifest serves shard downloads from the full model; a backbone file holds no "
                            "experts to serve (start `p2pswarm serve-shards` where the full model is)")
        market_kwargs(args)  # bad market options: one line now, not after joining the swarm
        args.http_limits = http_limits(args)
        args.http_socket = bind_http(args.http)
    if args.relay:
        if args.role != "worker":
            raise UserError("--relay is for workers behind NAT (backbones dial relayed workers by themselves)")
        from p2pswarm.net.libp2p.addrs import parse_peer_addr
        from p2pswarm.net.signed.tokens import load_token

        args.relay_auto = "auto" in args.relay
        args.relay = [a for a in args.relay if a != "auto"]
        if args.relay_auto and not args.bootstrap:
            raise UserError("--relay auto finds relays in the DHT: give --bootstrap ADDR too")
        for addr in args.relay:
            parse_peer_addr(addr)
        args.relay_token = load_token(args.token) if args.token else None
    line_buffered_stdout()
    args.cut = 0
    trio.run(_worker if args.role == "worker" else _backbone, args)
    if args.cut:
        log.error("stopped with %d requests cut (each got an error); exit status 1", args.cut)
        return 1
    return 0
