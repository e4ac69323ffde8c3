"""The backbone's HTTP endpoint: the OpenAI API users call, and what an operator looks at.

A plain ASGI application served by hypercorn's trio worker, so it shares the backbone's event
loop. This module only routes and shapes requests and responses; parameters and the text loop
are in :mod:`p2pswarm.backbone.completion`, chat rendering in :mod:`p2pswarm.backbone.chat`, the
status page in :mod:`p2pswarm.backbone.status_page`, metrics in :mod:`p2pswarm.backbone.metrics`.
Every route and parameter is documented in docs/api.md.

* ``GET /`` the status page; ``GET /v1/swarm`` its JSON (coverage, workers, tokens/s)
* ``GET /health``; ``GET /metrics`` (Prometheus text format)
* ``GET /v1/models``, ``GET /v1/models/{id}``
* ``POST /v1/completions`` and ``POST /v1/chat/completions``, plain or streamed (server-sent
  events: one ``data: {...}`` chunk per piece of text, the last with ``finish_reason``, then the
  usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``)

Refused requests get OpenAI's error shape (:mod:`p2pswarm.backbone.openai_errors`), never a traceback.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import trio

from p2pswarm.backbone.chat import ChatError, ChatTemplate, read_chat_template
from p2pswarm.backbone.completion import GenParams, Usage, generate_text, parse_params
from p2pswarm.backbone.generate import generate
from p2pswarm.backbone.metrics import BackboneMetrics
from p2pswarm.backbone.openai_errors import APIError, bad_request, model_not_found, no_route
from p2pswarm.backbone.runner import Backbone
from p2pswarm.backbone.status_page import SwarmView, status_html
from p2pswarm.http_server import lifespan, send_json, serve_asgi

log = logging.getLogger("p2pswarm.http")
MAX_BODY = 1 << 20
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class CompletionsApp:
    """ASGI app over one backbone and its tokenizer.

    ``model_path`` (the GGUF) gives the chat template and the layout the status page draws;
    ``view`` overrides the latter (a swarm backbone passes its resolver's block size)."""

    def __init__(self, backbone: Backbone, tokenizer, model_name: str, fingerprint: str, *,
                 model_path=None, view: SwarmView | None = None, chat_template: str | None = None):
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.created = int(time.time())
        if chat_template is None and model_path is not None:
            chat_template = read_chat_template(model_path)
        self.chat = ChatTemplate(chat_template, tokenizer) if chat_template else None
        if view is None and model_path is not None:
            from p2pswarm.model.layout import ModelLayout

            view = SwarmView.for_backbone(backbone, ModelLayout.open(model_path))
        self.view = view
        self.active = 0
        self.metrics = BackboneMetrics(backbone.dispatcher, self._coverage, lambda: self.active)
        self._routes = {
            ("GET", "/"): self._status_page,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/swarm"): self._swarm,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat_completions,
        }

    # -- the one place generation starts ---------------------------------------------------------
    @asynccontextmanager
    async def open_generation(self, prompt_ids: list[int], *, max_tokens: int, sampler):
        """Token steps (``generate.Step``) for one request. The batching scheduler's
        ``scheduler.submit(prompt_ids, Params(max_tokens=, sampler=))`` has this same shape:
        pointing this at it makes every endpoint's requests share decode steps."""
        steps = generate(self.backbone, self.tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler)
        self.active += 1
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        try:
            yield steps
        finally:
            self.active -= 1
            await steps.aclose()

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        handler = self._routes.get((method, path))
        endpoint = path if handler else "other"
        if handler is None and method == "GET" and path.startswith("/v1/models/"):
            handler, endpoint = self._model, "/v1/models/{id}"
        status = [500]

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if handler is None:
                raise no_route(method, path)
            await handler(scope, receive, counted_send)
        except APIError as exc:
            await send_json(counted_send, exc.status, exc.body())
        except Exception:
            log.exception("%s %s failed", method, path)
            if status[0] == 500:  # nothing sent yet
                await send_json(counted_send, 500, APIError(500, "internal error (see the backbone's log)",
                                                            type="server_error").body())
        finally:
            self.metrics.http_requests.labels(endpoint, str(status[0])).inc()

    # -- operator routes -------------------------------------------------------------------------
    async def _status_page(self, scope, receive, send):
        page = status_html()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                (b"content-length", str(len(page)).encode())]})
        await send({"type": "http.response.body", "body": page})

    async def _health(self, scope, receive, send):
        stats = self.backbone.dispatcher.stats
        await send_json(send, 200, {"status": "ok", "model": self.model_name, "fingerprint": self.fingerprint,
                                    "expert_requests": stats.requests, "fallbacks": stats.fallbacks,
                                    "active_sequences": self.active, "chat_template": self.chat is not None})

    async def _metrics(self, scope, receive, send):
        payload, ctype = self.metrics.render()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    def _coverage(self) -> tuple[int, int, int]:
        if self.view is None:
            return 0, 0, sum(1 for o in self.backbone.dispatcher.owners if o.remote)
        return self.view.coverage_counts()

    async def _swarm(self, scope, receive, send):
        if self.view is None:
            raise APIError(404, "this backbone was started without its model file: no swarm view", code="not_found")
        await send_json(send, 200, self.view.snapshot(
            model=self.model_name, fingerprint=self.fingerprint, active=self.active, rate=self.metrics.rate,
            metrics_totals={"tokens_generated": self.metrics.total_tokens}))

    # -- OpenAI routes ---------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "p2pswarm"}

    async def _models(self, scope, receive, send):
        await send_json(send, 200, {"object": "list", "data": [self._model_card()]})

    async def _model(self, scope, receive, send):
        name = scope["path"][len("/v1/models/"):]
        if name != self.model_name:
            raise model_not_found(name, self.model_name)
        await send_json(send, 200, self._model_card())

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)

    async def _completions(self, scope, receive, send):
        body = await _read_json(receive)
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # the openai client may send a one-string list
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string (one prompt per request)", param="prompt")
        params = parse_params(body, chat=False, n_vocab=self.tokenizer.n_vocab)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise bad_request("the prompt tokenizes to nothing", param="prompt")
        await self._respond(send, ids, params, chat=False)

    async def _chat_completions(self, scope, receive, send):
        body = await _read_json(receive)
        self._check_model(body)
        if self.chat is None:
            raise bad_request(f"the model '{self.model_name}' has no chat template (tokenizer.chat_template in "
                              f"its GGUF): use /v1/completions", param="messages", code="no_chat_template")
        params = parse_params(body, chat=True, n_vocab=self.tokenizer.n_vocab)
        try:
            ids = self.chat.encode(body.get("messages"))
        except ChatError as exc:
            raise bad_request(str(exc), param="messages") from None
        if not ids:
            raise bad_request("the conversation renders to nothing", param="messages")
        await self._respond(send, ids, params, chat=True)

    async def _respond(self, send, ids: list[int], params: GenParams, *, chat: bool) -> None:
        """Run one generation and answer it, whole or as server-sent events."""
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": self.fingerprint[:16]}
        usage = Usage()
        pieces = generate_text(self.open_generation, ids, params, usage, on_token=self.metrics.generated)
        if not params.stream:
            text = "".join([p async for p in pieces])
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "finish_reason": usage.finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": usage.finish_reason, "logprobs": None}
            await send_json(send, 200, {**head, "object": "chat.completion" if chat else "text_completion",
                                        "choices": [choice], "usage": usage.as_dict()})
            return

        extra = {"usage": None} if params.include_usage else {}

        def chunk(text: str | None, finish: str | None, *, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "choices": [choice], **extra}

        async def event(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            if chat:
                await event(chunk(None, None, role=True))
            async for piece in pieces:
                await event(chunk(piece, None))
            await event(chunk(None, usage.finish_reason))
            if params.include_usage:
                await event({**head, "choices": [], "usage": usage.as_dict()})
        except Exception as exc:  # headers are out: report in-band, as OpenAI's stream does
            log.warning("stream %s failed: %s", cid, exc)
            err = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {exc}", type="server_error")
            await event(err.body())
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _read_json(receive) -> dict:
    body = bytearray()
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if len(body) > MAX_BODY:
            raise bad_request(f"request body over {MAX_BODY} bytes")
        if not msg.get("more_body"):
            break
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


async def serve_http(app: CompletionsApp, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets the bound addresses."""
    await serve_asgi(app, host, port, logger="p2pswarm.http.server", task_status=task_status)
