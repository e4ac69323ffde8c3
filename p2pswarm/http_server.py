"""What the backbone's API and the relay's health port share: hypercorn on trio serving an ASGI
app (both are Starlette apps; anyio runs them on trio), so HTTP shares the node's event loop."""
from __future__ import annotations

import logging
import socket

import trio


async def serve_asgi(app, host, port: int | None = None, *, logger: str,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` with hypercorn on trio until cancelled; ``task_status.started`` gets the
    bound addresses (``["http://127.0.0.1:PORT"]``), so port 0 works.

    ``host`` may instead be a bound, listening ``socket.socket`` (the caller checked the address
    before doing anything else): hypercorn then serves that very socket (``fd://``)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    if isinstance(host, socket.socket):
        config.bind = [f"fd://{host.detach()}"]  # hypercorn's socket object owns the descriptor now
    else:
        config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(logger)
    await serve(app, config, task_status=task_status)
