"""A worker's ``--health HOST:PORT``: ``GET /health`` (and ``/``) its state as JSON.

Why: a worker that backbones do not use (its kernel family, block size or protocol is not theirs,
or it is banned) used to look exactly like a working one, "serving" for ever. The backbones now
say why (p2pswarm/backbone/sessions/refusal_notice.py); this endpoint shows it beside what was served:
``status`` is ``serving`` (no backbone refused it), ``refused`` (every backbone that spoke to it
refused it) or ``partly refused``. ``wire``: the bytes received from and sent to backbones (what a
capped upload is spent on; the same counts as the stop log's).
"""
from __future__ import annotations

import trio

from p2pswarm.lifecycle import trio_tasks


def add_health_arg(p) -> None:
    p.add_argument("--health", metavar="HOST:PORT",
                   help="worker: serve GET /health (JSON: serving or refused, and why; what it served) here")


def worker_health(peer_id: str, stats, shards: list[str], dht=None) -> dict:
    refused = dict(stats.refused_by)
    users = set(stats.peers) - set(refused)
    status = "serving" if not refused else ("partly refused" if users else "refused")
    w = stats.wire  # every connection's bytes, as the frames met the transport (p2pswarm.net.wire.counting)
    total = w.sent + w.received
    return {"status": status, "peer_id": peer_id, "shards": shards, "requests": stats.requests, "rows": stats.rows,
            "backbones_served": len(stats.peers), "refused_by": refused,
            "handshakes_refused": stats.refused,
            "wire": {"received": w.received, "sent": w.sent,
                     "bytes_per_request": round(total / stats.requests, 1) if stats.requests else None},
            # what a soak samples for leaks (bench/soak.py)
            "trio_tasks": trio_tasks(), "dht_records": dht.records_held() if dht is not None else None}


async def start_health(nursery, sock, report) -> str:
    """Serve ``report()`` as JSON on the bound socket ``sock``; returns the /health URL."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from p2pswarm.http_server import serve_asgi

    async def health(_request):
        return JSONResponse(report())

    app = Starlette(routes=[Route("/", health), Route("/health", health)])
    binds = await nursery.start(lambda task_status=trio.TASK_STATUS_IGNORED: serve_asgi(
        app, sock, logger="p2pswarm.worker.http", task_status=task_status))
    return f"{binds[0]}/health"
