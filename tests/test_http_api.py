"""The backbone's OpenAI-style HTTP endpoint, served by hypercorn on trio over a real socket."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import trio

from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.engine.text.tokenizer import Tokenizer


async def _with_server(model, fn, workers=0):
    async with open_backbone(model, workers=workers, transport="inproc") as swarm:
        app = CompletionsApp(swarm.backbone, Tokenizer.from_gguf(model), "tiny", swarm.fingerprint, model_path=model)
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
                         json.dumps({"prompt": "x", "temperature": "hot"}).encode(),
                         b'{"prompt": "lone \\ud800 surrogate"}',  # not valid Unicode
                         json.dumps({"prompt": "x", "max_tokens": 600}).encode()):  # tiny's context is 512
                r = c.post("/v1/completions", content=body)
                assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
            r = c.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
            assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]
            assert c.get("/nope").status_code == 404

    await _with_server(tiny_f32, client)


@pytest.fixture
def no_template(tiny_f32, tmp_path):
    """The tiny model with its tokenizer.chat_template key renamed (same length): a real GGUF
    that carries no chat template."""
    data = tiny_f32.read_bytes()
    assert data.count(b"tokenizer.chat_template") == 1
    path = tmp_path / "no-template.gguf"
    path.write_bytes(data.replace(b"tokenizer.chat_template", b"tokenizer.chat_templatX"))
    return path


async def test_model_without_template_refuses_chat_and_still_completes(no_template):
    def client(base):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "no_chat_template" and "no chat template" in e.value.message
        r = c.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        assert httpx.get(base + "/health").json()["chat_template"] is False

    await _with_server(no_template, client)


async def test_client_leaving_a_stream_ends_its_generation(tiny_f32):
    """The client reads two chunks of a 400-token stream and hangs up: the sequence ends there
    (Starlette cancels the response), it does not run on to max_tokens."""
    def client(base):
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 400, "stream": True}) as s:
                lines = s.iter_lines()
                assert next(lines).startswith("data: ")
                assert c.get("/health").json()["active_sequences"] == 1
            deadline = time.time() + 20
            while c.get("/health").json()["active_sequences"]:
                assert time.time() < deadline
                time.sleep(0.1)
            swarm = c.get("/v1/swarm").json()
            assert swarm["active_sequences"] == 0 and swarm["tokens_generated"] < 300

    await _with_server(tiny_f32, client)


def test_status_page_counts_replicas_per_expert(tiny_f32):
    """Workers holding experts 0-5, 6-10 and 11-15 touch blocks 0-7 and 8-15 twice each, yet every
    expert has one copy: the heat-map says 1 per unit (its least-covered expert), as swarm-status."""
    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher
    from p2pswarm.backbone.owners.socket_owner import SocketOwner
    from p2pswarm.backbone.api.status_page import SwarmView
    from p2pswarm.engine.experts.numpy_bank import ExpertBank
    from p2pswarm.model.layout import ModelLayout

    layout = ModelLayout.open(tiny_f32)
    owners = [SocketOwner(f"w{i}", "127.0.0.1", 1, model_fingerprint="x", kernel="numpy",
                          layers=(0, layout.n_layer), experts=span)
              for i, span in enumerate([(0, 6), (6, 11), (11, 16)])]
    view = SwarmView(Dispatcher(ExpertBank(layout), owners), layers=layout.expert_layers,
                     n_expert=layout.n_expert, block_size=8)
    units = view.units()
    assert len(units) == len(layout.expert_layers) * 2
    assert {u["replicas"] for u in units} == {1} and {u["known"] for u in units} == {1}
    owners[1].refused = "kernel mismatch"  # refused at the handshake: known, never live
    assert {u["replicas"] for u in view.units()} == {0}
@pytest.mark.slow
async def test_concurrent_completions_through_the_scheduler_equal_one_at_a_time(tiny_f32):
    """With the continuous-batching scheduler (as `node --role backbone` runs it) concurrent
    requests share decode steps and each text equals the same request served alone; a client that
    hangs up mid-stream is cancelled at the next step."""
    from p2pswarm.backbone.serving.scheduler import Scheduler

    prompts = [f"request {i} to the swarm" for i in range(6)]
    tok = Tokenizer.from_gguf(tiny_f32)
    async with open_backbone(tiny_f32, workers=2, transport="inproc") as swarm:
        plain = CompletionsApp(swarm.backbone, tok, "tiny", swarm.fingerprint, model_path=tiny_f32)
        batched = CompletionsApp(swarm.backbone, tok, "tiny", swarm.fingerprint, model_path=tiny_f32,
                                 scheduler=Scheduler(swarm.backbone, tok))
        async with trio.open_nursery() as nursery:
            bases = []
            for app in (plain, batched):
                binds = await nursery.start(serve_http, app, "127.0.0.1", 0)
                bases.append(binds[0].replace("0.0.0.0", "127.0.0.1"))

            def complete(base, p):
                r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0},
                               timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            def hang_up(base):
                with httpx.Client(base_url=base, timeout=60) as c:
                    with c.stream("POST", "/v1/completions",
                                  json={"prompt": "x", "max_tokens": 400, "stream": True}) as s:
                        assert s.status_code == 200
                        for i, _ in enumerate(s.iter_lines()):
                            if i >= 4:
                                break

            with trio.fail_after(300):
                alone = [await trio.to_thread.run_sync(complete, bases[0], p) for p in prompts]
                together: dict[int, str] = {}

                async def one(i):
                    together[i] = await trio.to_thread.run_sync(complete, bases[1], prompts[i])

                async with trio.open_nursery() as clients:
                    for i in range(len(prompts)):
                        clients.start_soon(one, i)
                health = (await trio.to_thread.run_sync(lambda: httpx.get(bases[1] + "/health", timeout=30))).json()
                await trio.to_thread.run_sync(hang_up, bases[1])
                while batched.scheduler.stats.cancelled == 0:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert [together[i] for i in range(len(prompts))] == alone
    assert health["generated_tokens"] == 36 and health["steps"] < 36
    assert batched.scheduler.stats.generated < 36 + 300
