"""Argument helpers shared by the commands that run a model (logits, generate, demo)."""
from __future__ import annotations

import argparse

from p2pswarm.errors import UserError

KERNEL_CHOICES = ("auto", "numpy", "ggml", "portable")


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
    p.add_argument("--refresh", type=float, default=30.0, metavar="SECONDS",
                   help="--swarm: re-resolve the expert owners through the DHT this often (default 30; "
                        "also at once whenever an owner fails)")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="--swarm: experts per coverage unit, as the swarm's nodes use (default 8)")
    add_kernel_args(p)


def require_full_model(path) -> None:
    """Refuse (one line, exit 2) a file that is not a full model before any work starts: an expert
    shard or backbone file cut by `p2pswarm slice`, passed where the full model GGUF belongs."""
    from p2pswarm.model.layout import ModelLayout

    ModelLayout.open(path).require_full_model()


def open_model(args):
    """The backbone context a command asked for: through the swarm (--swarm), N local workers
    (--workers) or monolithic. Yields an object with ``.backbone``."""
    from p2pswarm.backbone.session import open_backbone

    if args.swarm:
        from p2pswarm.backbone.swarm_session import open_swarm_backbone  # imports libp2p: only when asked

        if args.workers:
            raise UserError("--swarm and --workers exclude each other")
        if not args.refresh > 0:
            raise UserError("--refresh must be > 0 seconds")
        from p2pswarm.net.records import DEFAULT_BLOCK_SIZE

        block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
        if block_size < 1:
            raise UserError("--block-size must be >= 1")
        return open_swarm_backbone(args.model, bootstrap=args.swarm, kernel=args.kernel, threads=args.threads,
                                   timeout_s=args.timeout, refresh_s=args.refresh, dht_server=False,
                                   block_size=block_size)
    return open_backbone(args.model, workers=args.workers, transport=args.transport, fallback=not args.no_fallback,
                         timeout_s=args.timeout, kernel=args.kernel, threads=args.threads)


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
