"""What the backbone's API and the relay's health port share: hypercorn on trio serving an ASGI
app (both are Starlette apps; anyio runs them on trio), so HTTP shares the node's event loop."""
from __future__ import annotations

import logging

import trio


async def serve_asgi(app, host: str, port: int, *, logger: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` with hypercorn on trio until cancelled; ``task_status.started`` gets the
    bound addresses (``["http://127.0.0.1:PORT"]``), so port 0 works."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(logger)
    await serve(app, config, task_status=task_status)
