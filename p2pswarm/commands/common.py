"""Argument helpers shared by the commands that run a model (logits, generate, demo)."""
from __future__ import annotations

import argparse
import io
import sys
import logging

from p2pswarm import settings
from p2pswarm.errors import UserError

KERNEL_CHOICES = settings.KERNELS


def add_kernel_args(p) -> None:
    """``--kernel`` and ``--threads``: which code computes the experts (see docs/kernels.md)."""
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default=None,
                   help="expert kernel: ggml on the quantised bytes (libggml, built by pip install), numpy on "
                        "float32 (~7x the memory), portable (the same bits on every ISA: x86-64 and ARM workers "
                        "in one swarm), or auto (ggml where libggml loads, else numpy with a warning saying how "
                        "to get ggml; default, or $P2PSWARM_KERNEL)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="ggml/portable threads (default $P2PSWARM_THREADS, else the CPUs available, at most 8)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _verify_rate(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        r = -1.0
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return r


def add_market_args(p, prefix: str = "") -> None:
    """A backbone's checks of untrusted workers and its receipts (docs/market.md, "Receipts and
    verification"). ``prefix``: a word put before each help (e.g. "--swarm: ")."""
    from p2pswarm.market.verify import DEFAULT_CHECK_FETCH_BYTES, DEFAULT_VERIFY_RATE

    p.add_argument("--verify-rate", type=_verify_rate, default=DEFAULT_VERIFY_RATE, metavar="FRACTION",
                   help=f"{prefix}recompute this fraction of the workers' output rows on the local replica, bit for "
                        f"bit; a mismatch bans the worker swarm-wide and replays what used its unchecked rows "
                        f"(0 = off; default {DEFAULT_VERIFY_RATE})")
    p.add_argument("--verify-fetch-budget", default=None, metavar="SIZE",
                   help=f"{prefix}with a partial --expert-cache, a check of a unit the cache lacks fetches its slabs "
                        f"(manifest-checked) from a holder and drops them after: at most SIZE a minute "
                        f"(default {DEFAULT_CHECK_FETCH_BYTES // 1_000_000}MB; 0 = check cached units only)")
    p.add_argument("--verify-seed", type=int, default=None,
                   help=f"{prefix}seed of the verification sample (default: fresh entropy, unpredictable to workers)")
    p.add_argument("--trust-bans", action="append", default=[], metavar="PEER_ID",
                   help=f"{prefix}also honour the ban records this backbone signs (repeatable; our own always count)")
    p.add_argument("--receipt-period", type=float, default=60.0, metavar="SECONDS",
                   help=f"{prefix}send each worker a signed receipt for its work this often (and on exit)")
    p.add_argument("--ban-refresh", type=float, default=30.0, metavar="SECONDS",
                   help=f"{prefix}look up the bans of the workers in use this often (new workers: before their "
                        f"first request)")


def market_kwargs(args) -> dict:
    if not args.receipt_period > 0 or not args.ban_refresh > 0:
        raise UserError("--receipt-period and --ban-refresh must be > 0 seconds")
    from p2pswarm.signatures import peer_id_bytes, peer_public_key

    for peer in args.trust_bans:
        peer_id_bytes(peer)  # one line for a malformed id, before joining the swarm
        peer_public_key(peer)
    from p2pswarm.market.auto import parse_size
    from p2pswarm.market.verify import DEFAULT_CHECK_FETCH_BYTES

    budget = DEFAULT_CHECK_FETCH_BYTES
    if args.verify_fetch_budget is not None:
        text = args.verify_fetch_budget.strip()
        try:
            budget = 0 if text in ("0", "0B", "0b") else parse_size(text)
        except UserError:
            raise UserError(f"--verify-fetch-budget {text!r}: expected a size like 64MB (a minute's worth) "
                            "or 0") from None
    return {"verify_rate": args.verify_rate, "verify_seed": args.verify_seed, "trust_bans": args.trust_bans,
            "receipt_period_s": args.receipt_period, "ban_refresh_s": args.ban_refresh,
            "verify_fetch_budget": budget}


def add_expert_cache_arg(p, prefix: str = "") -> None:
    """``--expert-cache``: how many routed experts the backbone keeps (backbone/owners/expert_cache.py)."""
    p.add_argument("--expert-cache", metavar="SIZE|N%|all|none", default=None,
                   help=f"{prefix}routed experts the backbone keeps and computes itself: all, none, a share "
                        "(10%%) or a size (1.5GB); the workers compute the rest. Default: all when the model "
                        "file holds them, for a backbone file (`slice --backbone`) what fits half the free "
                        "memory (stated in the log). A size that does not fit free memory is refused")


def expert_cache_size(args):
    """The parsed ``--expert-cache`` (None: the default), or a one-line error."""
    from p2pswarm.backbone.owners.expert_cache import parse_cache_size

    text = getattr(args, "expert_cache", None)
    return None if text is None else parse_cache_size(text)


def add_swarm_args(p) -> None:
    p.add_argument("--workers", type=int, default=0,
                   help="expert workers to split the experts among (0 = monolithic, the default)")
    p.add_argument("--transport", choices=("socket", "inproc"), default="socket",
                   help="workers as separate OS processes on local sockets (default) or in this process")
    p.add_argument("--no-fallback", action="store_true",
                   help="fail instead of recomputing a failed worker's experts on the local replica")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a worker's reply")
    p.add_argument("--swarm", action="append", default=None, metavar="MULTIADDR",
                   help="compute through the swarm: find expert owners via the DHT of this bootstrap peer "
                        "(repeatable; excludes --workers)")
    p.add_argument("--swarm-identity", metavar="KEY",
                   help="--swarm: this backbone's Ed25519 key file (receipts and bans are signed with it; "
                        "default: a throw-away key)")
    p.add_argument("--refresh", type=float, default=30.0, metavar="SECONDS",
                   help="--swarm: re-resolve the expert owners through the DHT this often (default 30; "
                        "also at once whenever an owner fails)")
    add_market_args(p, "--swarm: ")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="--swarm: experts per coverage unit, as the swarm's nodes use (default 8)")
    add_expert_cache_arg(p)
    add_kernel_args(p)


def add_speculate_args(p, prefix: str = "") -> None:
    """``--speculate`` and ``--draft-max`` (speculative decoding; docs/configuration.md)."""
    p.add_argument("--speculate", choices=("auto", "off", "ngram", "mtp"), default="auto",
                   help=prefix + "speculative decoding: draft tokens and verify them in the same step, exact "
                        "(the same tokens as without); ngram: prompt lookup; mtp: the model's own MTP block "
                         "(glm4moe, qwen35moe, deepseek2; other architectures refused); auto (default): mtp where the "
                         "model file has an MTP block (a backbone file too: drafts through the workers only where "
                         "the measured costs say they pay), otherwise off (the log says which)")
    p.add_argument("--draft-max", type=int, default=4, metavar="K",
                   help=prefix + "most tokens drafted per sequence and step; each step's length maximises expected tokens "
                        "per second from the recent acceptance and the measured costs of a draft token and a "
                        "verified row (default 4)")


def speculation_from(args, model_path):
    """The scheduler's :class:`~p2pswarm.backbone.serving.speculation.Speculation` from ``--speculate`` /
    ``--draft-max``, or None (off); a mode the model cannot run or a bad K: one line, exit 2.
    ``auto``: :func:`~p2pswarm.backbone.serving.speculation.auto_mode`, logged."""
    from p2pswarm.backbone.serving.speculation import Speculation, auto_mode, check_mode
    from p2pswarm.model.layout import ModelLayout

    if args.draft_max < 1:
        raise UserError(f"--draft-max must be >= 1, not {args.draft_max}")
    mode = args.speculate
    if mode == "auto":  # (a backbone file holds the hyper-parameters too; auto_mode checks its experts)
        mode, why = auto_mode(ModelLayout.open(model_path, require_experts=False))
        logging.getLogger("p2pswarm.speculation").info("--speculate auto: %s (%s)", mode, why)
    if mode == "off":
        return None
    if mode == "mtp":
        check_mode(mode, ModelLayout.open(model_path, require_experts=False))
    return Speculation(mode, args.draft_max)


def require_full_model(path) -> None:
    """Refuse (one line, exit 2) a file that is not a full model before any work starts: an expert
    shard or backbone file cut by `p2pswarm slice`, passed where the full model GGUF belongs."""
    from p2pswarm.model.layout import ModelLayout

    ModelLayout.open(path).require_full_model()


def require_backbone_model(path) -> None:
    """As :func:`require_full_model`, but a backbone file (`slice --backbone`) is welcome too: a
    backbone started from it keeps no experts but its cache (backbone/owners/expert_cache.py)."""
    from p2pswarm.model.layout import ModelLayout

    layout = ModelLayout.open(path)
    if layout.shard_kind != "backbone":
        layout.require_full_model()


def open_model(args):
    """The backbone context a command asked for: through the swarm (--swarm), N local workers
    (--workers) or monolithic. Yields an object with ``.backbone``."""
    from p2pswarm.backbone.sessions.local import open_backbone

    if args.swarm:
        from p2pswarm.backbone.sessions.swarm import open_swarm_backbone  # imports libp2p: only when asked

        if args.workers:
            raise UserError("--swarm and --workers exclude each other")
        if not args.refresh > 0:
            raise UserError("--refresh must be > 0 seconds")
        from p2pswarm.net.signed.identity import load_or_create_identity
        from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

        identity = load_or_create_identity(args.swarm_identity, exclusive=True) if args.swarm_identity else None

        block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
        if block_size < 1:
            raise UserError("--block-size must be >= 1")
        return open_swarm_backbone(args.model, bootstrap=args.swarm, kernel=args.kernel, threads=args.threads,
                                   timeout_s=args.timeout, refresh_s=args.refresh, dht_server=False,
                                   identity=identity, block_size=block_size, expert_cache=expert_cache_size(args),
                                   **market_kwargs(args))
    return open_backbone(args.model, workers=args.workers, transport=args.transport, fallback=not args.no_fallback,
                         timeout_s=args.timeout, kernel=args.kernel, threads=args.threads,
                         expert_cache=expert_cache_size(args))


def parse_hostport(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host may be bracketed) for ``flag``, or a one-line UserError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise UserError(f"bad {flag} {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def parse_ids(text: str, what: str = "--tokens") -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UserError(f"bad {what} {text[:40]!r}: expected comma-separated integers like 1,2,3") from None
    if not ids:
        raise UserError(f"{what} is empty")
    return ids


def check_workers(n: int) -> None:
    if n < 0:
        raise UserError("--workers must be >= 0")


def line_buffered_stdout() -> None:
    """Flush stdout at each line: a node's READY line and progress reach whoever reads its pipe (a
    test, a supervisor) at once, not when a block buffer fills."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
