"""The backbone's HTTP endpoint: the OpenAI API users call, and what an operator looks at.

A Starlette application (anyio, so it runs on trio) served by hypercorn's trio worker: it shares
the backbone's event loop. This module only routes and shapes requests and responses; parameters
and the text loop are in :mod:`p2pswarm.backbone.api.completion`, chat rendering in :mod:`p2pswarm.backbone.api.chat`, the
status page in :mod:`p2pswarm.backbone.api.status_page`, metrics in :mod:`p2pswarm.backbone.api.metrics`.
Every route and parameter is documented in docs/api.md.

* ``GET /`` the status page; ``GET /v1/swarm`` its JSON (coverage, workers, tokens/s)
* ``GET /health``; ``GET /metrics`` (Prometheus text format)
* ``GET /v1/models``, ``GET /v1/models/{id}``
* ``POST /v1/completions`` and ``POST /v1/chat/completions``, plain or streamed (server-sent
  events: one ``data: {...}`` chunk per piece of text, the last with ``finish_reason``, then the
  usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``)

Stopping (:meth:`CompletionsApp.drain`, on SIGINT/SIGTERM): new requests get a 503 at once; running
ones get ``--drain-s`` seconds to finish; those still running then are cut: a streamed one ends
with an error event in OpenAI's shape, a non-streamed one gets a 503. So a client always learns
that its answer is incomplete, instead of reading a connection reset as an early end.

Refused requests get OpenAI's error shape (:mod:`p2pswarm.backbone.api.openai_errors`), never a traceback.
A streamed response whose client goes away is cancelled (Starlette watches for the disconnect),
which ends its generation at the next step instead of running to ``max_tokens``.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from functools import partial
from typing import Any, Callable

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from p2pswarm.backbone.api.admission import Admission, HttpLimits
from p2pswarm.backbone.api.chat import ChatError, ChatTemplate, read_chat_template
from p2pswarm.backbone.api.completion import GenParams, Usage, generate_text, parse_params
from p2pswarm.backbone.serving.scheduler import Params, Scheduler
from p2pswarm.backbone.api.metrics import BackboneMetrics, wire_summary
from p2pswarm.backbone.api.openai_errors import APIError, bad_request, model_not_found, no_route
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.backbone.api.status_page import SwarmView, status_html
from p2pswarm.errors import InternalError, PeerError, UnitsUnavailable, UserError
from p2pswarm.http_server import serve_asgi
from p2pswarm.lifecycle import trio_tasks

log = logging.getLogger("p2pswarm.http")
#: the routes that start a generation: admitted (or refused with a 429) by :class:`Admission`
_GENERATING = ("/v1/completions", "/v1/chat/completions")


class CompletionsApp:
    """ASGI app over one backbone and its tokenizer.

    ``model_path`` (the GGUF) gives the chat template, the context length requests must fit in
    and the layout the status page draws; ``view`` overrides the latter (a swarm backbone passes
    its resolver's block size)."""

    def __init__(self, backbone: Backbone, tokenizer, model_name: str, fingerprint: str, *,
                 model_path=None, view: SwarmView | None = None, chat_template: str | None = None,
                 scheduler: Scheduler | None = None, limits: HttpLimits | None = None,
                 extra_health: Callable[[], dict] | None = None):
        self.backbone = backbone
        self.limits = limits or HttpLimits()
        self.admission = Admission(self.limits)
        self.extra_health = extra_health  # more /health fields (a swarm backbone: its DHT records held)
        # The continuous-batching Scheduler: every request of both endpoints shares decode steps
        # (and is replayed on a ban). Default: one with the default settings; serve_http runs it.
        self.scheduler = scheduler if scheduler is not None else Scheduler(backbone, tokenizer)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.created = int(time.time())
        if chat_template is None and model_path is not None:
            chat_template = read_chat_template(model_path)
        self.chat = ChatTemplate(chat_template, tokenizer) if chat_template else None
        self.n_ctx = getattr(backbone.model, "n_ctx_train", None)
        if model_path is not None:
            from p2pswarm.model.layout import ModelLayout

            layout = ModelLayout.open(model_path)
            self.n_ctx = int(layout.hparams.get("context_length") or 0) or self.n_ctx
            if view is None:
                view = SwarmView.for_backbone(backbone, layout)
        self.view = view
        self.in_flight = 0  # requests whose response is not finished (a stream: until its last event)
        self.draining = False  # stopping: new requests are refused
        self.cutting = False  # the drain period is over: running generations end at their next token
        self.metrics = BackboneMetrics(backbone.dispatcher, self._coverage, lambda: self.active,
                                       backbone.replays, spec=self.scheduler.spec)
        self.app = Starlette(
            routes=[
                Route("/", self._status_page),
                Route("/health", self._health),
                Route("/metrics", self._metrics),
                Route("/v1/swarm", self._swarm),
                Route("/v1/models", self._models),
                Route("/v1/models/{model:path}", self._model),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
            ],
            exception_handlers=_EXCEPTION_HANDLERS)

    # -- the one place generation starts ---------------------------------------------------------
    @property
    def active(self) -> int:
        """Sequences generating now."""
        return self.scheduler.active

    async def steps(self, prompt_ids: list[int], params: GenParams, request_id: str):
        """Token steps (:class:`~p2pswarm.backbone.serving.items.Step`) for one request, through the
        scheduler (``scheduler.submit``; closing the iterator early cancels the sequence; a replay
        on ban shows up as a ``Rewind`` among the steps), ending with a 503 :class:`APIError` at
        the first token after the drain period (streamed: the error event; whole: the response)."""
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        submitted = Params(max_tokens=params.max_tokens, sampler=params.sampler(), request_id=request_id)
        async with self.scheduler.submit(prompt_ids, submitted, rewinds=True) as steps:
            async for step in steps:
                if self.cutting:
                    raise APIError(503, "the backbone is shutting down: this request was cut before it finished "
                                   "(its drain period ran out); retry it", type="server_error", code="shutting_down")
                yield step

    async def drain(self, drain_s: float) -> int:
        """Stop taking requests, give the running ones ``drain_s`` seconds (a second SIGINT/SIGTERM
        ends the wait), then cut the rest and wait a moment for their error responses to go out.
        Returns how many requests were cut."""
        import signal

        self.draining = True
        if self.in_flight:
            log.info("draining: %d requests running, up to %g s for them to finish", self.in_flight, drain_s)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as again:
            async def second_signal(scope) -> None:
                async for _ in again:
                    log.info("second signal: cutting the running requests now")
                    scope.cancel()
                    return

            async with trio.open_nursery() as nursery:
                with trio.move_on_after(drain_s) as wait:
                    nursery.start_soon(second_signal, wait)
                    while self.in_flight:
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        cut = self.in_flight
        if cut:
            self.cutting = True
            log.warning("cutting %d requests still running after the drain period: each gets an error", cut)
            with trio.move_on_after(5):
                while self.in_flight:
                    await trio.sleep(0.05)
            await trio.sleep(0.2)  # the last bytes of those responses on their way out
        return cut

    # -- ASGI: Starlette routes; requests counted by route and status -----------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        client = (scope.get("client") or ("?",))[0]
        admitted = scope.get("method") == "POST" and scope.get("path") in _GENERATING
        try:
            if admitted:
                try:  # from the body's first byte to the stream's last: nothing outlives its slot
                    self.admission.enter(client)
                except APIError as exc:
                    admitted = False
                    await JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)(
                        scope, receive, counted_send)
                    return
            await self.app(scope, receive, counted_send)
        finally:
            if admitted:
                self.admission.leave(client)
            endpoint = getattr(scope.get("route"), "path", None) or "other"  # bounded label values
            self.metrics.http_requests.labels(endpoint, str(status[0])).inc()

    # -- operator routes -------------------------------------------------------------------------
    async def _status_page(self, request: Request) -> Response:
        return Response(status_html(), media_type="text/html; charset=utf-8")

    async def _health(self, request: Request) -> Response:
        stats = self.backbone.dispatcher.stats
        sched = self.scheduler
        generated = sched.stats.generated
        return JSONResponse({"status": "draining" if self.draining else "ok", "model": self.model_name,
                             "fingerprint": self.fingerprint,
                             "expert_requests": stats.requests, "fallbacks": stats.fallbacks,
                             "active_sequences": self.active, "chat_template": self.chat is not None,
                             "http_running": self.admission.running, "http_refused": self.admission.refused,
                             "generated_tokens": generated,
                             "steps": sched.stats.steps,
                             "micro_batches": sched.last_micro_batches,
                             "dense_s": self.backbone.timing.dense_s,
                             "dense_busy_s": self.backbone.timing.busy_s,
                             "dispatch_wait_s": self.backbone.timing.wait_s,
                             "banned_workers": len(self.backbone.dispatcher.bans.banned),
                             "replays": self.backbone.replays.as_dict(),
                             "speculation": sched.spec.as_dict(sched.speculate),
                             "wire": wire_summary(self.backbone.dispatcher, generated),
                             "trio_tasks": trio_tasks(), **(self.extra_health() if self.extra_health else {})})

    async def _metrics(self, request: Request) -> Response:
        payload, ctype = self.metrics.render()
        return Response(payload, media_type=ctype)

    def _coverage(self) -> tuple[int, int, int]:
        if self.view is None:
            return 0, 0, sum(1 for o in self.backbone.dispatcher.owners if o.remote)
        return self.view.coverage_counts()

    async def _swarm(self, request: Request) -> Response:
        if self.view is None:
            raise APIError(404, "this backbone was started without its model file: no swarm view", code="not_found")
        return JSONResponse(self.view.snapshot(
            model=self.model_name, fingerprint=self.fingerprint, active=self.active, rate=self.metrics.rate,
            metrics_totals={"tokens_generated": self.metrics.total_tokens,
                            "speculation": self.scheduler.spec.as_dict(self.scheduler.speculate),
                            "wire": wire_summary(self.backbone.dispatcher, self.metrics.total_tokens)}))

    # -- OpenAI routes ---------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "p2pswarm"}

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            raise model_not_found(name, self.model_name)
        return JSONResponse(self._model_card())

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)

    async def _completions(self, request: Request) -> Response:
        body = await _read_json(request, self.limits)
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # the openai client may send a one-string list
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string (one prompt per request)", param="prompt")
        params = parse_params(body, chat=False, n_vocab=self.tokenizer.n_vocab,
                              max_tokens_limit=self.limits.max_tokens)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise bad_request("the prompt tokenizes to nothing", param="prompt")
        return await self._respond(ids, params, chat=False)

    async def _chat_completions(self, request: Request) -> Response:
        body = await _read_json(request, self.limits)
        self._check_model(body)
        if self.chat is None:
            raise bad_request(f"the model '{self.model_name}' has no chat template (tokenizer.chat_template in "
                              f"its GGUF): use /v1/completions", param="messages", code="no_chat_template")
        params = parse_params(body, chat=True, n_vocab=self.tokenizer.n_vocab,
                              max_tokens_limit=self.limits.max_tokens)
        try:
            ids = self.chat.encode(body.get("messages"))
        except ChatError as exc:
            raise bad_request(str(exc), param="messages") from None
        if not ids:
            raise bad_request("the conversation renders to nothing", param="messages")
        return await self._respond(ids, params, chat=True)

    async def _respond(self, ids: list[int], params: GenParams, *, chat: bool) -> Response:
        """Run one generation and answer it, whole or as server-sent events."""
        if self.draining:
            raise APIError(503, "the backbone is shutting down and takes no new requests; retry on another "
                           "backbone or after its restart", type="server_error", code="shutting_down")
        if self.n_ctx and len(ids) + params.max_tokens > self.n_ctx:
            raise bad_request(f"this model's context is {self.n_ctx} tokens; the request asks for "
                              f"{len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} to "
                              f"generate): shorten it or lower max_tokens", param="max_tokens",
                              code="context_length_exceeded")
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": self.fingerprint[:16]}
        usage = Usage()
        pieces = generate_text(self.steps(ids, params, cid), len(ids), params, usage,
                               on_token=self.metrics.generated, hold=not params.stream)
        if params.stream:  # in flight from its first event to its last (_sse)
            return StreamingResponse(_sse(head, pieces, usage, params, chat=chat, counter=self),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.in_flight += 1
        try:
            text = "".join([p async for p in pieces])
        finally:
            self._finished()
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": usage.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": usage.finish_reason, "logprobs": None}
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage.as_dict()})

    def _finished(self) -> None:
        self.in_flight -= 1


async def _sse(head: dict, pieces, usage: Usage, params: GenParams, *, chat: bool, counter=None):
    """The server-sent events of one streamed completion (see the module doc for their order);
    ``counter.in_flight`` counts it from its first event to its last (``[DONE]``)."""
    if counter is not None:
        counter.in_flight += 1
    try:
        async for event in _events(head, pieces, usage, params, chat=chat):
            yield event
    finally:
        if counter is not None:
            counter._finished()


async def _events(head: dict, pieces, usage: Usage, params: GenParams, *, chat: bool):
    extra = {"usage": None} if params.include_usage else {}

    def chunk(text: str | None, finish: str | None, *, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**head, "choices": [choice], **extra}

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if chat:
            yield event(chunk(None, None, role=True))
        async for piece in pieces:
            yield event(chunk(piece, None))
        yield event(chunk(None, usage.finish_reason))
        if params.include_usage:
            yield event({**head, "choices": [], "usage": usage.as_dict()})
    except Exception as exc:  # the status line is out: report in-band, as OpenAI's stream does
        log.warning("stream %s failed: %s", head["id"], exc)
        err = (exc if isinstance(exc, APIError) else units_unavailable(exc) if isinstance(exc, UnitsUnavailable)
               else APIError(500, f"generation failed: {exc}", type="server_error"))
        yield event(err.body())
    yield "data: [DONE]\n\n"


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _user_error(request: Request, exc: UserError) -> Response:
    """Input the model cannot take (a lone surrogate in the text, a token id out of range): a 400."""
    return JSONResponse(bad_request(str(exc)).body(), status_code=400)


async def _peer_error(request: Request, exc: PeerError) -> Response:
    """A peer failed us where no fallback could (the client's request was fine): a 502, logged
    with the peer."""
    log.warning("%s %s failed: peer %s: %s", request.method, request.url.path, exc.peer or "?", exc)
    return JSONResponse(APIError(502, f"a peer failed: {exc}", type="server_error").body(), status_code=502)


def units_unavailable(exc: UnitsUnavailable) -> APIError:
    """Routed experts nobody in the swarm could compute (every replica gone, no peer holding the
    bytes): a 503 naming them - the request was fine, the swarm lacks part of the model now."""
    return APIError(503, f"the swarm cannot compute part of the model now: {exc}", type="server_error",
                    code="experts_unavailable")


async def _units_unavailable(request: Request, exc: UnitsUnavailable) -> Response:
    log.warning("%s %s failed: %s", request.method, request.url.path, exc)
    return JSONResponse(units_unavailable(exc).body(), status_code=503)


async def _internal_error(request: Request, exc: InternalError) -> Response:
    """Our fault or the installation's: a 500 that says what, logged."""
    log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return JSONResponse(APIError(500, str(exc), type="server_error").body(), status_code=500)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    if exc.status_code == 404:
        err = no_route(request.method, request.url.path)
    else:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse(APIError(500, "internal error (see the backbone's log)", type="server_error").body(),
                        status_code=500)


#: what each kind of error becomes (p2pswarm/errors.py: whose fault it is); typed loosely because
#: Starlette types a handler as taking any Exception
_EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: _api_error, UserError: _user_error, UnitsUnavailable: _units_unavailable, PeerError: _peer_error,
    InternalError: _internal_error,
    HTTPException: _http_error, Exception: _server_error}


async def _read_json(request: Request, limits: HttpLimits) -> dict:
    """The body as a JSON object: at most ``limits.max_body_bytes`` (413), whole within
    ``limits.body_timeout_s`` (408: a client trickling its body holds a slot no longer), else 400."""
    body = bytearray()
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {cap} (--max-body-bytes)",
                       code="request_too_large")
    with trio.move_on_after(limits.body_timeout_s) as waited:
        async for part in request.stream():
            body += part
            if len(body) > cap:
                raise APIError(413, f"request body over the limit of {cap} bytes (--max-body-bytes)",
                               code="request_too_large")
    if waited.cancelled_caught:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                       f"(--body-timeout-s)", code="request_timeout")
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


async def serve_http(app: CompletionsApp, host_or_socket, port: int | None = None, *,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` (and run its scheduler's step loop) until cancelled on
    ``host``:``port``, or on an already bound listening socket; ``task_status.started`` gets the
    bound addresses."""
    async with trio.open_nursery() as nursery:
        await nursery.start(app.scheduler.run)
        lim = app.limits
        binds = await nursery.start(partial(serve_asgi, app, host_or_socket, port, logger="p2pswarm.http.server",
                                            keep_alive_s=lim.keep_alive_s))
        task_status.started(binds)
