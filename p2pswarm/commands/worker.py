"""`p2pswarm worker --shard S --listen HOST:PORT`: serve one expert shard on a local socket.

Prints ``READY host:port`` on stdout once listening (port 0 picks a free one), so a parent process
knows where to connect; logs go to stderr. Stops cleanly on SIGINT/SIGTERM.
"""
from __future__ import annotations

import logging
import signal
import sys

import trio

from p2pswarm.commands.common import add_kernel_args, parse_hostport
from p2pswarm.errors import UserError
from p2pswarm.net.wire.framing import DEFAULT_MAX_FRAME
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import ServeStats, serve_tcp

log = logging.getLogger("p2pswarm.worker")


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="the worker process that `logits`/`generate --workers N` start and connect to "
                          "themselves (no other client); run a worker of your own with `node --role worker`")
    p.add_argument("--shard", required=True, help="expert shard GGUF cut by `p2pswarm slice`")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME,
                   help=f"largest frame accepted, in bytes (default {DEFAULT_MAX_FRAME})")
    add_kernel_args(p)
    p.set_defaults(func=run)


async def _main(worker: ExpertWorker, host: str, port: int, max_frame: int) -> None:
    def ready(h, p):
        log.info("serving %s on %s:%d", worker.info.describe(), h, p)
        print(f"READY {h}:{p}", flush=True)

    served = ServeStats()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_tcp(worker, host, port, ready=ready, max_frame=max_frame, stats=served))
            async for sig in signals:
                # Debug, not info: this process is a child of logits/generate/demo, which stop it
                # after their output (their own stats say what the workers did); at info its lines
                # came after the generated text.
                log.debug("signal %s: shutting down", signal.Signals(sig).name)
                nursery.cancel_scope.cancel()
                break
    log.debug("served %d expert requests (%d rows); wire: received %d bytes, sent %d bytes", served.requests,
              served.rows, served.wire.received, served.wire.sent)


def run(args) -> int:
    host, port = parse_hostport(args.listen)
    worker = ExpertWorker(args.shard, kernel=args.kernel, threads=args.threads)
    log.info("kernel %s", worker.info.kernel)
    try:
        trio.run(_main, worker, host, port, args.max_frame)
    except OSError as exc:
        raise UserError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    sys.stdout.flush()
    return 0
