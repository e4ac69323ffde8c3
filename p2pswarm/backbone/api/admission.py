"""The HTTP API's abuse limits: how many completions run at once (in all, and per client), how big a
request body and ``max_tokens`` may be, and how long a client may take to send its request.

Why: without them one client could start any number of generations (each holds a sequence in the
scheduler and memory for its KV cache; 300 concurrent requests were all admitted before these
limits) and others would wait behind it. A request over a cap is refused at once with a 429 in
OpenAI's error shape and a ``Retry-After`` header (the official client waits that long and retries),
never queued: a queue that grows with the flood only moves the problem.

A client is its IP address (``scope["client"]``): a key or header would be the client's own choice,
so a flooder could rotate it. Behind a reverse proxy every request comes from the proxy's address:
raise ``--max-requests-per-client`` there, or limit per client in the proxy.

Slow clients (slowloris): hypercorn closes a connection whose request headers have not all arrived
within its keep-alive timeout (``keep_alive_s``; the connection counts as idle until then), and an
idle one between requests; a body must arrive whole within ``body_timeout_s``
(:func:`p2pswarm.backbone.api.http_api._read_json`), else a 408. No read timeout: hypercorn's runs while
a request is answered, when the client rightly sends nothing (p2pswarm.http_server.serve_asgi).
"""
from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.backbone.api.openai_errors import APIError
from p2pswarm.errors import UserError


@dataclass(frozen=True)
class HttpLimits:
    """The caps (``node --role backbone`` flags of the same names; docs/configuration.md)."""

    max_requests: int = 256  # completions running at once, all clients (--max-requests)
    max_requests_per_client: int = 32  # completions running at once, one client address
    max_body_bytes: int = 1 << 20  # a request body
    max_tokens: int = 4096  # the most a request may ask to generate (max_tokens / max_completion_tokens)
    body_timeout_s: float = 30.0  # a request body must arrive whole within this
    # an idle connection (no request, or headers not complete) is closed after this. Longer than the
    # official openai client's pool expiry (httpx: 5 s), so the client drops an idle connection before
    # we do: at 5 s both closed together and a request sent on a connection we were closing was lost
    # ("Server disconnected without sending a response"; found by the soak, tests/test_abuse_limits.py)
    keep_alive_s: float = 10.0
    retry_after_s: int = 1  # the Retry-After of a 429

    def check(self) -> HttpLimits:
        for name in ("max_requests", "max_requests_per_client", "max_body_bytes", "max_tokens", "retry_after_s"):
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{_flag(name)} must be > 0 seconds, got {getattr(self, name)}")
        return self


def _flag(field: str) -> str:
    return "max-tokens-limit" if field == "max_tokens" else field.replace("_", "-")


class Admission:
    """Counts the completions running per client and in all; :meth:`enter` refuses one over a cap
    with a 429 :class:`APIError`, :meth:`leave` gives its slot back (the caller's ``finally``)."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.running = 0
        self.per_client: dict[str, int] = {}
        self.refused = 0  # 429s given (GET /health shows it)

    def enter(self, client: str) -> None:
        lim = self.limits
        mine = self.per_client.get(client, 0)
        if mine >= lim.max_requests_per_client:
            self.refused += 1
            raise _too_many(f"this client ({client}) already has {mine} requests running, the most one client may "
                            f"have at once (--max-requests-per-client {lim.max_requests_per_client}): wait for one "
                            f"to finish and retry", lim.retry_after_s)
        if self.running >= lim.max_requests:
            self.refused += 1
            raise _too_many(f"the backbone is running {self.running} requests, its limit (--max-requests "
                            f"{lim.max_requests}): retry after a moment", lim.retry_after_s)
        self.running += 1
        self.per_client[client] = mine + 1

    def leave(self, client: str) -> None:
        self.running -= 1
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]  # bounded by the clients running requests now, not by all ever seen


def _too_many(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, type="requests", code="rate_limit_exceeded",
                    headers={"retry-after": str(retry_after_s)})
