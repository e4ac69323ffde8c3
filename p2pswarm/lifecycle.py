"""How long-running nodes stop: on SIGINT or SIGTERM, by cancelling their main scope, so every
``finally`` (withdrawing DHT records, closing connections) runs."""
from __future__ import annotations

import logging
import signal

import trio

log = logging.getLogger("p2pswarm.node")


def trio_tasks() -> int:
    """Tasks alive in the running trio loop: a soak samples it (bench/soak.py), since a count that
    grows with the work done is a leak."""
    stack = [trio.lowlevel.current_root_task()]
    n = 0
    while stack:
        task = stack.pop()
        n += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return n


async def until_signal(cancel_scope: trio.CancelScope, ready: str | None = None, *,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Wait for SIGINT/SIGTERM, log it, and cancel ``cancel_scope``.

    ``ready`` (the ``READY ...`` line a parent process waits for) is printed only once the signal
    receiver is installed: a parent that sends SIGTERM the moment it reads READY must get a clean
    shutdown, not the default action (exit -15 with nothing withdrawn). Started with
    ``nursery.start``, it returns once the receiver is installed: a node whose start-up takes long
    (an ``--auto`` worker waiting for a shard source) is stopped cleanly by either signal then too."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        if ready is not None:
            print(ready, flush=True)
        async for sig in signals:
            log.info("signal %s: shutting down", signal.Signals(sig).name)
            cancel_scope.cancel()
            return
