"""`p2pswarm node`'s option checks that need more than argparse: what a worker serves (a shard
file, a slice to download, or units it picks itself) and its DHT mode. Why apart: each refusal is
one line before anything starts (no half-joined node), and the rules read as one list here.
"""
from __future__ import annotations

import re

from p2pswarm.errors import UserError


def check_worker_source(args) -> None:
    """A worker serves a shard file (--shard), or downloads its slice first (--model FINGERPRINT
    --layers --experts --token --trust-issuer; --shard then names where it goes), or enrols by
    itself (--auto --memory SIZE --token TOKEN --trust-issuer PEER_ID)."""
    if args.auto:
        from p2pswarm.market.auto import parse_size
        from p2pswarm.net.signed.tokens import load_token

        clash = [f for f, v in (("--shard", args.shard), ("--layers", args.layers), ("--experts", args.experts))
                 if v]
        if clash:
            raise UserError(f"--auto picks its own units: drop {', '.join(clash)}")
        missing = [f for f, v in (("--memory", args.memory), ("--token", args.token),
                                  ("--trust-issuer", args.trust_issuer)) if not v]
        if missing:
            from p2pswarm.net.signed.tokens import AUTO_SCOPE

            raise UserError(f"--auto needs {', '.join(missing)} (a token issued with {AUTO_SCOPE})")
        if args.model is not None:
            if not re.fullmatch(r"[0-9a-fA-F]{64}", args.model):
                raise UserError(f"--model {args.model[:70]!r}: with --auto, a model fingerprint (64 hex digits)")
            args.model = args.model.lower()
        if not args.enrol_period > 0:
            raise UserError("--enrol-period must be > 0 seconds")
        args.memory_bytes = parse_size(args.memory)
        args.node_token = load_token(args.token)
        return
    if args.memory:
        raise UserError("--memory is for --auto workers")
    if not args.model:
        if not args.shard:
            raise UserError("--role worker needs --shard SHARD.gguf, or --model FINGERPRINT --layers A-B "
                            "--experts C-D --token TOKEN --trust-issuer PEER_ID to download its slice")
        return
    from p2pswarm.model.slicer import parse_range
    from p2pswarm.net.signed.tokens import load_token

    if not re.fullmatch(r"[0-9a-fA-F]{64}", args.model):
        raise UserError(f"--model {args.model[:70]!r}: a worker takes a model fingerprint (64 hex digits) "
                        f"to download its slice of; serve a local file with --shard")
    missing = [f for f, v in (("--layers", args.layers), ("--experts", args.experts), ("--token", args.token),
                              ("--trust-issuer", args.trust_issuer)) if not v]
    if missing:
        raise UserError(f"downloading a slice needs {', '.join(missing)}")
    args.model = args.model.lower()
    args.layer_range = parse_range(args.layers, "layer")
    args.expert_range = parse_range(args.experts, "expert")
    args.node_token = load_token(args.token)
    args.fetch = True


def check_dht_mode(args) -> None:
    """Resolve a worker's ``--dht``: client by default for ``--auto`` and ``--relay`` workers.

    Why an --auto worker is a client: 30 of them as servers saturated 2 cores (docs/benchmarks.md,
    "Coverage market: 30 --auto workers, before/after"): each answered the others' look-ups and
    record puts, was one more hop in every iterative look-up (each touching ~20 peers) and
    refreshed its routing table at start-up; as clients an idle one costs 0.19x the CPU. A phone
    should not carry the DHT's load. Records then live at the DHT servers (bootstrap and backbone
    nodes), where backbones look them up anyway."""
    relayed = bool(args.relay)  # `--relay auto` too
    if args.role != "worker":
        if args.dht_mode is not None:
            raise UserError("--dht is for --role worker (a backbone always serves the DHT)")
        return
    if args.dht_mode == "server" and relayed:
        raise UserError("--dht server needs a dialable worker: behind a --relay nobody can reach its kad; drop --dht")
    if args.dht_mode is None:
        args.dht_mode = "client" if args.auto or relayed else "server"


def add_http_limit_args(p) -> None:
    """The backbone's HTTP abuse limits (p2pswarm.backbone.api.admission.HttpLimits: defaults, why)."""
    from p2pswarm.backbone.api.admission import HttpLimits

    d = HttpLimits()
    p.add_argument("--max-requests", type=int, default=d.max_requests, metavar="N",
                   help="backbone: completions running at once, all clients; one more gets a 429 with Retry-After "
                        f"(default {d.max_requests})")
    p.add_argument("--max-requests-per-client", type=int, default=d.max_requests_per_client, metavar="N",
                   help="backbone: completions running at once from one client IP address; one more gets a 429 "
                        f"(default {d.max_requests_per_client}; behind a reverse proxy every client is the proxy)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N",
                   help=f"backbone: the largest request body; a larger one gets a 413 (default {d.max_body_bytes})")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens, metavar="N",
                   help="backbone: the largest max_tokens (or max_completion_tokens) a request may ask for; more is "
                        f"a 400 (default {d.max_tokens})")
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s, metavar="SECONDS",
                   help="backbone: a request body must arrive whole within this, else a 408 "
                        f"(default {d.body_timeout_s:g})")
    p.add_argument("--read-timeout-s", type=float, default=None, metavar="SECONDS",
                   help="backbone: ignored (kept so that existing command lines start): it cut answers longer than "
                        "it; --keep-alive-s and --body-timeout-s bound idle and slow clients")
    p.add_argument("--keep-alive-s", type=float, default=d.keep_alive_s, metavar="SECONDS",
                   help="backbone: an idle HTTP connection, or one whose request headers are not complete, is "
                        f"closed after this (slow clients; default {d.keep_alive_s:g})")


def http_limits(args):
    """The checked :class:`HttpLimits` of ``add_http_limit_args``' flags (one line on a bad value)."""
    from p2pswarm.backbone.api.admission import HttpLimits

    if args.read_timeout_s is not None:
        import logging

        logging.getLogger("p2pswarm.node").warning(
            "--read-timeout-s is ignored: a read timeout cut answers longer than it and lost the next request on "
            "the connection; --keep-alive-s and --body-timeout-s bound idle and slow clients")
    return HttpLimits(max_requests=args.max_requests, max_requests_per_client=args.max_requests_per_client,
                      max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit,
                      body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s).check()


def add_worker_limit_args(p) -> None:
    """A worker's caps per peer (p2pswarm.worker.peer_limits.PeerLimits: defaults, why)."""
    from p2pswarm.worker.peer_limits import PeerLimits

    d = PeerLimits()
    p.add_argument("--max-streams-per-peer", type=int, default=d.max_streams_per_peer, metavar="N",
                   help="worker: expert streams one peer may hold open at once; one more is refused with an error "
                        f"frame (default {d.max_streams_per_peer})")
    p.add_argument("--max-peer-mib", type=int, default=d.max_bytes_per_peer >> 20, metavar="MIB",
                   help="worker: request bytes one peer may have in flight at once, all its streams; a frame over "
                        f"it closes its stream with an error (default {d.max_bytes_per_peer >> 20})")


def peer_budget(args):
    """A fresh :class:`PeerBudget` of ``add_worker_limit_args``' flags (one line on a bad value)."""
    from p2pswarm.worker.peer_limits import PeerBudget, PeerLimits

    return PeerBudget(PeerLimits(max_streams_per_peer=args.max_streams_per_peer,
                                 max_bytes_per_peer=args.max_peer_mib << 20).check())
