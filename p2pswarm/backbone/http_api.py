"""The backbone's user-facing HTTP endpoint: an OpenAI-style ``/v1/completions`` (plain or streamed).

A minimal ASGI application (no web framework: three routes do not need one) served by hypercorn's
trio worker, so it shares the backbone's event loop. Routes:

* ``GET /health`` -> ``{"status": "ok", "model": ..., "fingerprint": ...}``
* ``GET /v1/models`` -> the one model this backbone serves
* ``POST /v1/completions`` with ``{"prompt": str, "max_tokens": int, "temperature": float,
  "top_p": float, "seed": int, "stream": bool}``; with ``stream`` the reply is server-sent events,
  one ``data: {...}`` per token and ``data: [DONE]`` at the end, as OpenAI clients expect.

Every completion goes through one :class:`~p2pswarm.backbone.scheduler.Scheduler` entry point,
``scheduler.submit(prompt_ids, params)``: concurrent requests are batched together step by step
(continuous batching), and a client that disconnects cancels its sequence. Bad requests get a 400
with ``{"error": {"message": ...}}``, never a traceback; a request whose step failed gets a 500.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from functools import partial

import trio

from p2pswarm.backbone.runner import Backbone
from p2pswarm.backbone.sampling import Sampler
from p2pswarm.backbone.scheduler import Params, Scheduler
from p2pswarm.http_server import lifespan, send_json, serve_asgi

log = logging.getLogger("p2pswarm.http")
MAX_BODY = 1 << 20
MAX_TOKENS_LIMIT = 4096


class BadRequest(Exception):
    pass


class CompletionsApp:
    """ASGI app over one backbone and its tokenizer."""

    def __init__(self, backbone: Backbone, tokenizer, model_name: str, fingerprint: str, *,
                 scheduler: Scheduler | None = None):
        self.backbone = backbone
        self.scheduler = scheduler or Scheduler(backbone, tokenizer)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = fingerprint

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "GET" and path == "/health":
                stats = self.backbone.dispatcher.stats
                await send_json(send, 200, {"status": "ok", "model": self.model_name, "fingerprint": self.fingerprint,
                                        "expert_requests": stats.requests, "fallbacks": stats.fallbacks,
                                        "active_sequences": self.scheduler.active,
                                        "steps": self.scheduler.stats.steps,
                                        "micro_batches": self.scheduler.last_micro_batches,
                                        "dense_s": self.backbone.timing.dense_s,
                                        "dispatch_wait_s": self.backbone.timing.wait_s,
                                        "generated_tokens": self.scheduler.stats.generated})
            elif method == "GET" and path == "/v1/models":
                await send_json(send, 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
            elif method == "POST" and path == "/v1/completions":
                request = self._parse_completion(await _read_json(receive))
                async with trio.open_nursery() as nursery:  # a client that hangs up cancels its sequence
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                    await self._completions(request, send)
                    nursery.cancel_scope.cancel()
            else:
                await send_json(send, 404, {"error": {"message": f"no route {method} {path}"}})
        except BadRequest as exc:
            await send_json(send, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})

    def _parse_completion(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string")
        max_tokens = _number(body, "max_tokens", 16, int, 1, MAX_TOKENS_LIMIT)
        temperature = _number(body, "temperature", 1.0, float, 0.0, 10.0)
        top_p = _number(body, "top_p", 1.0, float, 1e-6, 1.0)
        seed = _number(body, "seed", 0, int, 0, 2**63 - 1)
        stream = bool(body.get("stream", False))
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise BadRequest("the prompt tokenizes to nothing")
        return {"ids": ids, "stream": stream,
                "params": Params(max_tokens=max_tokens, sampler=Sampler(temperature, top_p, seed))}

    async def _completions(self, request: dict, send) -> None:
        ids, stream, params = request["ids"], request["stream"], request["params"]
        max_tokens = params.max_tokens
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        async with self.scheduler.submit(ids, params) as steps:
            if not stream:
                text, n, finish = "", 0, "length"
                try:
                    async for step in steps:
                        text += step.text
                        n += 1
                        if step.end:
                            finish = "stop"
                except Exception as exc:  # noqa: BLE001 - a failed step: the client hears why
                    await send_json(send, 500, {"error": {"message": str(exc), "type": "server_error"}})
                    return
                await send_json(send, 200, {
                    "id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
                })
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            n, finish = 0, None
            try:
                async for step in steps:
                    n += 1
                    finish = "stop" if step.end else ("length" if n == max_tokens else None)
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [{"index": 0, "text": step.text, "finish_reason": finish}]}
                    await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                                "more_body": True})
            except Exception as exc:  # noqa: BLE001 - mid-stream: an error event, then the end
                err = {"error": {"message": str(exc), "type": "server_error"}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _number(body: dict, key: str, default, kind, lo, hi):
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"'{key}' must be a number")
    v = kind(v)
    if not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}")
    return v


async def _cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _read_json(receive) -> dict:
    body = bytearray()
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if len(body) > MAX_BODY:
            raise BadRequest(f"request body over {MAX_BODY} bytes")
        if not msg.get("more_body"):
            break
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


async def serve_http(app: CompletionsApp, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` (and run its scheduler's step loop) until cancelled; ``task_status.started``
    gets the bound addresses."""
    async with trio.open_nursery() as nursery:
        await nursery.start(app.scheduler.run)
        binds = await nursery.start(partial(serve_asgi, app, host, port, logger="p2pswarm.http.server"))
        task_status.started(binds)
