"""How long-running nodes stop: on SIGINT or SIGTERM, by cancelling their main scope, so every
``finally`` (withdrawing DHT records, closing connections) runs."""
from __future__ import annotations

import logging
import signal

import trio

log = logging.getLogger("p2pswarm.node")


async def until_signal(cancel_scope: trio.CancelScope) -> None:
    """Wait for SIGINT/SIGTERM, log it, and cancel ``cancel_scope``."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("signal %s: shutting down", signal.Signals(sig).name)
            cancel_scope.cancel()
            return
