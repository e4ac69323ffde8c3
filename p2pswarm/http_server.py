"""What the backbone's API and the relay's health port share: hypercorn on trio serving an ASGI
app (both are Starlette apps; anyio runs them on trio), so HTTP shares the node's event loop."""
from __future__ import annotations

import errno
import logging
import socket

import trio

from p2pswarm.errors import UserError


async def serve_asgi(app, host, port: int | None = None, *, logger: str, keep_alive_s: float = 10.0,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` with hypercorn on trio until cancelled; ``task_status.started`` gets the
    bound addresses (``["http://127.0.0.1:PORT"]``), so port 0 works.

    Slow clients: a connection idle for ``keep_alive_s`` is closed (hypercorn counts a connection
    idle from its last answer until a request's headers are complete, so this also bounds how long
    headers may trickle in: slowloris; a body's pace is the app's to bound).

    No read timeout, on purpose: hypercorn 0.18 runs it while a request is being answered, when a
    client rightly sends nothing. Past it, a streamed answer was cut mid-stream, and a non-streamed
    one was delivered on a connection hypercorn no longer read: the client's pool sent its next
    request there, unanswered until the keep-alive timer reset the connection (the soak's lost
    requests; tests/test_abuse_limits.py).

    ``host`` may instead be a bound, listening ``socket.socket`` (the caller checked the address
    before doing anything else): hypercorn then serves that very socket (``fd://``)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    if isinstance(host, socket.socket):
        config.bind = [f"fd://{host.detach()}"]  # hypercorn's socket object owns the descriptor now
    else:
        config.bind = [f"{host}:{port}"]
    config.read_timeout = None  # see above (hypercorn's default too; said here so that nobody adds one back)
    config.keep_alive_timeout = keep_alive_s
    config.accesslog = None
    config.errorlog = logging.getLogger(logger)
    await serve(app, config, task_status=task_status)


def bind_http(text: str, flag: str = "--http") -> socket.socket | None:
    """``--http HOST:PORT``: bind it now, before the node joins the swarm, so a taken port is one
    line and exit 2 instead of a traceback after the node announced itself. The bound socket is
    then served as is (no window in which another process could take the port)."""
    if text == "off":
        return None
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UserError(f"bad {flag} {text!r}: expected HOST:PORT (e.g. 127.0.0.1:8000; port 0 picks one) or off")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"{flag} {text}: cannot resolve host {host!r}: {exc.strerror}") from None
    family, _type, _proto, _name, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn does: TIME_WAIT is no conflict
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = (f" (another node or program is listening there: choose another port with {flag} HOST:PORT, "
                f"port 0 for any free one{', or ' + flag + ' off' if flag == '--http' else ''})"
                if exc.errno == errno.EADDRINUSE else "")
        raise UserError(f"{flag} {text}: cannot listen there: {exc.strerror or exc}{hint}") from None
    return sock
