"""The wire's byte counters (p2pswarm.net.wire.counting) against what the sockets actually carried.

A TCP proxy in this test forwards the backbone-side owner's connection to a worker and counts the
bytes it forwards each way, independently of the counters: over plain TCP the owner's counters,
the dispatcher's total and the worker's :class:`ServeStats` must equal the proxy's counts exactly,
and what the framing adds is 8 bytes per frame (each frame under a MiB is one write)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import trio

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, pack_rows
from p2pswarm.backbone.sessions.local import ensure_shards
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.net.wire import expert_protocol as proto
from p2pswarm.net.wire.framing import HEADER
from p2pswarm.worker.expert_worker import ExpertWorker
from p2pswarm.worker.server import ServeStats, serve_tcp


@pytest.fixture
def shard(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    return ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)[0]


class CountingProxy:
    """Forwards each accepted connection to ``port`` and counts the bytes of each direction."""

    def __init__(self, port: int):
        self.port = port
        self.up = self.down = 0  # client -> server, server -> client
        self.closed = 0

    async def handle(self, client):
        server = await trio.open_tcp_stream("127.0.0.1", self.port)

        async def pump(src, dst, up: bool):
            try:
                while data := await src.receive_some(1 << 16):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                await trio.aclose_forcefully(dst)

        async with trio.open_nursery() as n:
            n.start_soon(pump, client, server, True)
            n.start_soon(pump, server, client, False)
        self.closed += 1


async def test_wire_counters_equal_the_bytes_the_sockets_carried(shard):
    worker = ExpertWorker(shard)
    info = worker.info
    served = ServeStats()
    rng = np.random.default_rng(7)
    async with trio.open_nursery() as nursery:
        where = {}
        ready = trio.Event()

        def listening(h, p):
            where["port"] = p
            ready.set()

        nursery.start_soon(partial(serve_tcp, worker, "127.0.0.1", 0, ready=listening, stats=served))
        await ready.wait()
        proxy = CountingProxy(where["port"])
        listeners = await nursery.start(trio.serve_tcp, proxy.handle, 0)
        proxy_port = listeners[0].socket.getsockname()[1]
        owner = SocketOwner("w", "127.0.0.1", proxy_port, model_fingerprint=info.model_fingerprint,
                            kernel=info.kernel, layers=(info.layer_begin, info.layer_end),
                            experts=(info.expert_begin, info.expert_end))
        dispatcher = Dispatcher(worker.bank, [owner])
        sent = [len(proto.pack(owner.hello()))]  # what the frames carry, rebuilt here
        rid = 0
        with trio.fail_after(60):
            for n_rows in (1, 3, 17):
                cur = rng.standard_normal((n_rows, info.n_embd)).astype(np.float32)
                groups = [(e, np.sort(rng.choice(n_rows, size=min(n_rows, 2), replace=False)).astype(np.int32))
                          for e in (info.expert_begin, info.expert_begin + 1)]
                outs = await owner.compute(info.layer_begin, cur, groups)
                want = worker.bank.forward_groups(info.layer_begin, cur, groups)
                assert all(np.array_equal(a, b) for a, b in zip(outs, want))
                rid += 1
                rows, local = pack_rows(cur, groups)
                # (the first request is built before the hello says the worker codes its outputs)
                sent.append(len(proto.ComputeRequest(rid, info.layer_begin, rows, local,
                                                     coding=owner.output_coding if rid > 1 else None).to_wire()))
            assert await owner.echo(b"x" * 1000) == b"x" * 1000
            rid += 1
            sent.append(len(proto.pack({"op": "echo", "id": rid, "payload": b"x" * 1000})))
            await owner.aclose()
            while proxy.closed < 1:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    w = owner.wire
    assert w.sent > 0 and w.received > 0
    assert (w.sent, w.received) == (proxy.up, proxy.down)  # exactly what the socket carried
    assert (served.wire.received, served.wire.sent) == (proxy.up, proxy.down)  # the worker's view
    assert (dispatcher.wire.sent, dispatcher.wire.received) == (w.sent, w.received)  # the backbone total
    # framing overhead: one 8-byte header per frame, each frame one write
    assert w.writes == 5 and served.wire.writes == 5  # hello, three computes, one echo; and their replies
    assert w.sent == sum(sent) + HEADER.size * len(sent)


@pytest.mark.slow
async def test_health_metrics_and_status_page_report_the_wire(tiny_f32):
    """Worker processes over sockets: /health, /metrics and /v1/swarm give the same byte counts,
    per generated token and per expert request, and per worker."""
    import httpx

    from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
    from p2pswarm.backbone.sessions.local import open_backbone
    from p2pswarm.engine.text.tokenizer import Tokenizer

    got = {}
    async with open_backbone(tiny_f32, workers=2, transport="socket") as swarm:
        app = CompletionsApp(swarm.backbone, Tokenizer.from_gguf(tiny_f32), "tiny", swarm.fingerprint,
                             model_path=tiny_f32)
        async with trio.open_nursery() as nursery:
            base = (await nursery.start(serve_http, app, "127.0.0.1", 0))[0].replace("0.0.0.0", "127.0.0.1")

            def client():
                with httpx.Client(base_url=base, timeout=60) as c:
                    r = c.post("/v1/completions", json={"prompt": "hello swarm", "max_tokens": 6, "temperature": 0})
                    assert r.status_code == 200, r.text
                    got["health"] = c.get("/health").json()
                    got["metrics"] = c.get("/metrics").text
                    got["swarm"] = c.get("/v1/swarm").json()

            with trio.fail_after(120):
                await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
    h, wire = got["health"], got["health"]["wire"]
    assert h["fallbacks"] == 0 and h["expert_requests"] > 0  # the workers computed it
    assert wire["sent"] > 0 and wire["received"] > 0
    assert wire["bytes_per_token"] == round((wire["sent"] + wire["received"]) / h["generated_tokens"], 1)
    assert wire["bytes_per_request"] == round((wire["sent"] + wire["received"]) / h["expert_requests"], 1)
    assert sum(o["sent"] for o in wire["owners"].values()) == wire["sent"]
    assert f'p2pswarm_wire_bytes_total{{direction="sent"}} {float(wire["sent"])}' in got["metrics"]
    assert 'p2pswarm_owner_wire_bytes_total{direction="received",owner="worker0"}' in got["metrics"]
    workers = got["swarm"]["workers"]
    assert sum(w["wire"]["received"] for w in workers) == wire["received"]
    assert got["swarm"]["wire"]["sent"] == wire["sent"]


async def test_worker_health_reports_its_wire_bytes(shard):
    """A worker's ``--health`` JSON, served over HTTP, carries the bytes its connections carried:
    the mirror image of the backbone-side owner's counters."""
    import socket

    import httpx

    from p2pswarm.worker.health import start_health, worker_health

    worker = ExpertWorker(shard)
    info = worker.info
    served = ServeStats()
    async with trio.open_nursery() as nursery:
        where, ready = {}, trio.Event()

        def listening(h, p):
            where["port"] = p
            ready.set()

        nursery.start_soon(partial(serve_tcp, worker, "127.0.0.1", 0, ready=listening, stats=served))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = await start_health(nursery, sock, lambda: worker_health("me", served, ["s"]))
        await ready.wait()
        owner = SocketOwner("w", "127.0.0.1", where["port"], model_fingerprint=info.model_fingerprint,
                            kernel=info.kernel, layers=(info.layer_begin, info.layer_end),
                            experts=(info.expert_begin, info.expert_end))
        async with httpx.AsyncClient() as client:
            with trio.fail_after(30):
                before = (await client.get(url)).json()["wire"]
                cur = np.ones((5, info.n_embd), np.float32)
                await owner.compute(info.layer_begin, cur, [(info.expert_begin, np.arange(5, dtype=np.int32))])
                after = (await client.get(url)).json()["wire"]
        await owner.aclose()
        nursery.cancel_scope.cancel()
    assert before == {"received": 0, "sent": 0, "bytes_per_request": None}
    assert (after["received"], after["sent"]) == (owner.wire.sent, owner.wire.received), after
    assert after["sent"] > 5 * info.n_embd  # the outputs crossed: 5 rows of n_embd values (coded or not)
    assert after["bytes_per_request"] == after["received"] + after["sent"]  # one request
