"""The backbone's OpenAI-style HTTP endpoint, served by hypercorn on trio over a real socket."""
from __future__ import annotations

import json

import httpx
import trio

from p2pswarm.backbone.http_api import CompletionsApp, serve_http
from p2pswarm.backbone.session import open_backbone
from p2pswarm.engine.tokenizer import Tokenizer


async def _with_server(model, fn, workers=0):
    async with open_backbone(model, workers=workers, transport="inproc") as swarm:
        app = CompletionsApp(swarm.backbone, Tokenizer.from_gguf(model), "tiny", swarm.fingerprint)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, "127.0.0.1", 0)
            base = binds[0].replace("0.0.0.0", "127.0.0.1")
            try:
                with trio.fail_after(120):
                    await trio.to_thread.run_sync(fn, base)
            finally:
                nursery.cancel_scope.cancel()


async def test_completions_plain_and_streamed_agree(tiny_f32):
    seen = {}

    def client(base):
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
            r = c.post("/v1/completions", json={"prompt": "hello swarm", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 8
            seen["plain"] = body["choices"][0]["text"]
            pieces = []
            with c.stream("POST", "/v1/completions",
                          json={"prompt": "hello swarm", "max_tokens": 8, "temperature": 0, "stream": True}) as s:
                assert s.headers["content-type"].startswith("text/event-stream")
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
                    elif line == "data: [DONE]":
                        seen["done"] = True
            seen["stream"] = "".join(pieces)

    await _with_server(tiny_f32, client, workers=2)
    assert seen["done"] and seen["plain"] == seen["stream"] and seen["plain"]


async def test_bad_requests_get_400(tiny_f32):
    def client(base):
        with httpx.Client(base_url=base, timeout=60) as c:
            for body in (b"not json", b"[1]", json.dumps({"prompt": ""}).encode(),
                         json.dumps({"prompt": "x", "max_tokens": -1}).encode(),
                         json.dumps({"prompt": "x", "temperature": "hot"}).encode()):
                r = c.post("/v1/completions", content=body)
                assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
            assert c.get("/nope").status_code == 404

    await _with_server(tiny_f32, client)


async def test_client_that_hangs_up_cancels_its_sequence(tiny_f32):
    """Requests go through the scheduler; a streaming client that disconnects is dropped at the next
    step instead of generating to max_tokens."""
    async with open_backbone(tiny_f32, workers=0) as swarm:
        app = CompletionsApp(swarm.backbone, Tokenizer.from_gguf(tiny_f32), "tiny", swarm.fingerprint)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, "127.0.0.1", 0)
            base = binds[0].replace("0.0.0.0", "127.0.0.1")

            def client():
                with httpx.Client(base_url=base, timeout=60) as c:
                    with c.stream("POST", "/v1/completions",
                                  json={"prompt": "hello", "max_tokens": 4000, "stream": True}) as s:
                        for i, _ in enumerate(s.iter_lines()):
                            if i >= 4:
                                break  # hang up mid-stream

            with trio.fail_after(120):
                await trio.to_thread.run_sync(client)
                while app.scheduler.stats.cancelled == 0:
                    await trio.sleep(0.05)
            assert app.scheduler.active == 0 and app.scheduler.stats.generated < 1000
            nursery.cancel_scope.cancel()
