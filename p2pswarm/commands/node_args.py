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
        from p2pswarm.net.tokens import load_token

        clash = [f for f, v in (("--shard", args.shard), ("--layers", args.layers), ("--experts", args.experts))
                 if v]
        if clash:
            raise UserError(f"--auto picks its own units: drop {', '.join(clash)}")
        missing = [f for f, v in (("--memory", args.memory), ("--token", args.token),
                                  ("--trust-issuer", args.trust_issuer)) if not v]
        if missing:
            from p2pswarm.net.tokens import AUTO_SCOPE

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
    from p2pswarm.net.tokens import load_token

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
