"""Abuse limits, measured from outside against real processes over real sockets: the backbone's
HTTP API (concurrent requests per client and in all: a 429 with Retry-After in OpenAI's shape;
body size; ``max_tokens``; slow clients) and a worker's per-peer caps (streams, bytes in flight).
In each, a well-behaved client is served during the flood.

Clients are told apart by IP address: the floods come from other loopback addresses
(127.0.0.2, ...; all of 127/8 is this machine on Linux), the well-behaved client from 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import time

import httpx
import openai
import pytest
import trio

from helpers.procs import Proc, wait_until

CHAT = [{"role": "user", "content": "Tell me about experts."}]


def _slow_body(base: str, source: str, declared: int = 1000) -> socket.socket:
    """A POST whose headers arrive whole and whose body never does: it holds a request slot until
    the body timeout."""
    host, port = base.removeprefix("http://").split(":")
    s = socket.socket()
    s.bind((source, 0))
    s.connect((host, int(port)))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
              f"content-length: {declared}\r\n\r\n{{\"messages\": ".encode())
    return s


def _client(base: str, source: str = "127.0.0.1") -> httpx.Client:
    return httpx.Client(base_url=base, timeout=30, transport=httpx.HTTPTransport(local_address=source))


def _recv_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


pytestmark = pytest.mark.slow  # real processes and floods: not in the quick subset


@pytest.fixture
def limited_backbone(tiny_f32, tmp_path):
    """A backbone computing locally (no workers: the limits are the HTTP layer's) with small caps."""
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--identity", str(tmp_path / "bb.key"),
               "--http", "127.0.0.1:0", "--served-model-name", "tiny", "--max-requests", "5",
               "--max-requests-per-client", "2", "--max-tokens-limit", "32", "--max-body-bytes", "4096",
               "--body-timeout-s", "6", "--keep-alive-s", "2"], tmp_path / "bb.log", env)
    try:
        yield next(w for w in bb.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1"), bb
    finally:
        bb.stop()


def test_http_limits_refuse_the_flood_and_serve_the_others(limited_backbone):
    base, bb = limited_backbone
    good = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    alone = good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    reference = alone.choices[0].message.content
    with _client(base) as c:
        def running():
            return c.get("/health").json()["http_running"]

        # One client (127.0.0.2) holds its 2 slots: a third request of its own gets a 429 at once.
        held = [_slow_body(base, "127.0.0.2") for _ in range(2)]
        wait_until(lambda: running() == 2, 10, what="2 held requests")
        with _client(base, "127.0.0.2") as flood:
            t0 = time.monotonic()
            r = flood.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
            assert time.monotonic() - t0 < 2  # refused, not queued
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "--max-requests-per-client 2" in err["message"], err
        flooder = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30,
                                http_client=httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")))
        with pytest.raises(openai.RateLimitError):
            flooder.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
        # ... while another client is served, plain and streamed, the same tokens as alone.
        during = good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        assert during.choices[0].message.content == reference
        pieces = [ch.choices[0].delta.content or "" for ch in good.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True) if ch.choices]
        assert "".join(pieces) == reference

        # Two more clients fill the backbone (5 in all): then anyone gets a 429 naming the total.
        held += [_slow_body(base, "127.0.0.3"), _slow_body(base, "127.0.0.3"), _slow_body(base, "127.0.0.4")]
        wait_until(lambda: running() == 5, 10, what="5 held requests")
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        assert r.status_code == 429 and "--max-requests 5" in r.json()["error"]["message"], r.text
        assert c.get("/health").json()["http_refused"] == 3

        # The held bodies never arrive: each gets a 408 within the body timeout, and its slot back.
        for s in held:
            reply = _recv_all(s, 12)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
            s.close()
        wait_until(lambda: running() == 0, 10, what="the slots given back")
        after = good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        assert after.choices[0].message.content == reference

        # max_tokens and body size
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 33})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = c.post("/v1/chat/completions", content=b'{"messages": "' + b"x" * 5000 + b'"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_slowloris_headers_are_cut_and_others_served(limited_backbone):
    """Connections trickling their headers are closed after the keep-alive timeout (2 s here), and
    a client is served meanwhile."""
    base, bb = limited_backbone
    host, port = base.removeprefix("http://").split(":")
    socks = []
    for _ in range(200):
        s = socket.socket()
        s.bind(("127.0.0.5", 0))
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    good = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0).choices
    for s in socks:  # one more header line a second: a slowloris client never finishes them
        try:
            s.sendall(b"X-a: b\r\n")
        except OSError:
            pass
    closed = 0
    for s in socks:
        left = max(0.1, t0 + 8 - time.monotonic())
        s.settimeout(left)
        try:
            closed += s.recv(1024) == b""
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        s.close()
    assert closed == len(socks), f"{closed} of {len(socks)} slowloris connections closed within 8 s"
    assert bb.proc.poll() is None


async def _echo(stream, payload: bytes) -> dict:
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.net.wire.framing import FrameReader, send_frame

    await send_frame(stream, proto.pack({"op": "echo", "id": 1, "payload": payload}))
    with trio.fail_after(10):
        frame = await FrameReader(stream).read_frame()
    return {"op": "closed"} if frame is None else proto.unpack(frame)


async def test_worker_caps_one_peers_streams_and_bytes_and_serves_the_others(tiny_f32, tmp_path):
    """A worker process with --max-streams-per-peer 3 --max-peer-mib 1: a peer's 4th stream gets an
    error frame and is closed, and so does a 2 MiB frame; another peer is served throughout, and
    the flooder's slots come back when its streams close."""
    from p2pswarm.model.slicer import slice_experts
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity

    shard = tmp_path / "shard.gguf"
    slice_experts(tiny_f32, shard, None, (0, 16))
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"),
               P2PSWARM_CACHE=str(tmp_path / "cache"))
    w = Proc(["node", "--role", "worker", "--shard", str(shard), "--identity", str(tmp_path / "w.key"),
              "--max-streams-per-peer", "3", "--max-peer-mib", "1"], tmp_path / "w.log", env)
    try:
        async with open_host(Identity.generate()) as flood, open_host(Identity.generate()) as good:
            held = [await flood.open_stream(w.addr, proto.PROTOCOL_EXPERT) for _ in range(3)]
            for s in held:
                assert (await _echo(s, b"mine"))["payload"] == b"mine"
            extra = await flood.open_stream(w.addr, proto.PROTOCOL_EXPERT)
            refused = await _echo(extra, b"one more")
            assert refused["op"] == "error" and "--max-streams-per-peer" in refused["error"], refused
            other = await good.open_stream(w.addr, proto.PROTOCOL_EXPERT)
            assert (await _echo(other, b"served")) ["payload"] == b"served"
            big = await _echo(held[0], b"x" * (2 << 20))
            assert big["op"] == "error" and "--max-peer-mib" in big["error"], big
            assert (await _echo(other, b"still served"))["payload"] == b"still served"
            for s in held + [extra]:
                await s.aclose()
            with trio.fail_after(20):  # the worker sees the closes; the flooder's slots come back
                while True:
                    again = await flood.open_stream(w.addr, proto.PROTOCOL_EXPERT)
                    if (await _echo(again, b"back"))["op"] == "echo":
                        break
                    await trio.sleep(0.5)
        assert w.proc.poll() is None
    finally:
        w.stop()
    log = (tmp_path / "w.log").read_text()
    assert "refused a stream from" in log and "Traceback" not in log, log[-3000:]


def _response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (headers and a Content-Length body) from a kept-alive socket;
    b"" if the server closed it."""
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head


def test_an_idle_connection_outlives_the_openai_clients_pool_expiry(tiny_f32, tmp_path):
    """The backbone keeps an idle keep-alive connection open longer than the official client's
    connection pool does (httpx's keepalive_expiry, 5 s), so the client always drops it first.
    Regression (the soak): both used 5 s, and a request the client sent on a pooled connection just
    as the server closed it was lost ("Server disconnected without sending a response"), 1 of 24
    requests spaced 4.85-5.15 s apart."""
    expiry = openai.DefaultHttpxClient()._transport._pool._keepalive_expiry  # the official client's pool: 5 s
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--identity", str(tmp_path / "bb.key"),
               "--http", "127.0.0.1:0", "--served-model-name", "tiny"], tmp_path / "bb.log", env)
    try:
        host, port = next(w for w in bb.ready if w.startswith("http="))[5:].removeprefix("http://").split(":")
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
            for i in range(2):
                if i:
                    time.sleep(expiry + 1.0)  # idle past the client's expiry: the server must still hold it
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _response(s).startswith(b"HTTP/1.1 200"), i
    finally:
        bb.stop()


def test_answers_longer_than_the_read_timeout_and_the_next_request_on_their_connection_are_served(tiny_f32,
                                                                                                  tmp_path):
    """Regression (the soaks' lost requests, docs/benchmarks.md "issue 45"): hypercorn 0.18 runs its
    read timeout while a request is answered, when a client rightly sends nothing. Past it, a
    streamed answer was cut ("incomplete chunked read") and a non-streamed one was delivered whole
    on a connection the server no longer read: the client's pool reused it and the next request on
    it got no answer until the keep-alive timer reset the connection ("Connection error.", no log
    line). The backbone now gives hypercorn no read timeout (idle and slow clients are bounded by
    --keep-alive-s and --body-timeout-s) and ``--read-timeout-s`` is accepted and ignored, one
    warning line: here 0.2 s, against answers of a second or more, each followed by a short
    request on the same pooled connection (the official client, as the soak's load sends them)."""
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--identity", str(tmp_path / "bb.key"),
               "--http", "127.0.0.1:0", "--served-model-name", "tiny", "--read-timeout-s", "0.2"], tmp_path / "bb.log", env)
    try:
        base = next(w for w in bb.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        hi = [{"role": "user", "content": "hi"}]

        def plain(n: int) -> str:
            r = client.chat.completions.create(model="tiny", messages=hi, max_tokens=n, temperature=0)
            assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
            return r.choices[0].message.content

        def streamed(n: int) -> str:
            with client.chat.completions.create(model="tiny", messages=hi, max_tokens=n, temperature=0,
                                                stream=True) as s:
                chunks = [c for c in s if c.choices]
            assert chunks[-1].choices[0].finish_reason == "length"
            return "".join(c.choices[0].delta.content or "" for c in chunks)

        outcomes, took = [], {}
        for name, call, n in (("long plain", plain, 490), ("next plain", plain, 4), ("long stream", streamed, 490),
                              ("next after the stream", plain, 4)):
            t0 = time.monotonic()
            try:
                out = call(n)
                outcomes.append((name, "ok", len(out)))
            except openai.APIError as exc:
                outcomes.append((name, f"{type(exc).__name__}: {exc} ({exc.__cause__!r})", 0))
            took[name] = time.monotonic() - t0
        assert all(o[1] == "ok" for o in outcomes), (outcomes, took)
        assert min(took["long plain"], took["long stream"]) > 0.6, f"{took}: too fast to test a 0.2 s read timeout"
        assert "--read-timeout-s is ignored" in bb.text(), bb.text()[-2000:]
    finally:
        bb.stop()
