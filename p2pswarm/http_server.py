"""The small HTTP pieces the backbone's API and the relay's health endpoint share: hypercorn on
trio serving a plain ASGI app, the ASGI lifespan handshake, and JSON responses."""
from __future__ import annotations

import json
import logging
import socket

import trio


async def lifespan(receive, send) -> None:
    """Answer hypercorn's ASGI lifespan messages until shutdown (we have nothing to set up)."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def send_json(send, status: int, obj: dict) -> None:
    payload = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


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
