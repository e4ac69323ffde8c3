"""Stopping a backbone: SIGTERM lets running requests finish within --drain-s while new
ones get a 503; requests still running after it are cut with an error in OpenAI's shape (a streamed
one an error event, a non-streamed one a 503) and the backbone exits non-zero. A real backbone
process, a real worker behind an emulated 40 ms link (so a generation runs for seconds), and the
official ``openai`` client."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from helpers.procs import Proc, free_ports, start_bootstrap, stop_all, stop_process
from p2pswarm.model.slicer import slice_experts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_swarm(tiny_f32, tmp_path_factory):
    """A bootstrap and one worker (every expert) reached through a 40 ms round-trip link: each
    decode step waits on it once per layer, a few tokens per second."""
    tmp = tmp_path_factory.mktemp("stop")
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp / "home"))
    slice_experts(tiny_f32, tmp / "all.gguf", None, (0, 16))
    wport, pport = free_ports(2)
    proxy = subprocess.Popen([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--target", f"127.0.0.1:{wport}",
                              "--listen", f"127.0.0.1:{pport}", "--rtt-ms", "40"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    nodes: list[Proc] = []
    try:
        assert proxy.stdout.readline().startswith("READY")
        boot = start_bootstrap(tmp, env)
        nodes.append(boot)
        nodes.append(Proc(["node", "--role", "worker", "--shard", str(tmp / "all.gguf"), "--bootstrap", boot.addr,
                           "--identity", str(tmp / "w.key"), "--listen", f"/ip4/127.0.0.1/tcp/{wport}",
                           "--announce", f"/ip4/127.0.0.1/tcp/{pport}"], tmp / "w.log", env))
        yield tiny_f32, boot, tmp, env
    finally:
        stop_all([n.proc for n in nodes])
        stop_process(proxy)


def _backbone(slow_swarm, name: str, drain_s: float) -> tuple[Proc, openai.OpenAI, str]:
    model, boot, tmp, env = slow_swarm
    bb = Proc(["node", "--role", "backbone", "--model", str(model), "--bootstrap", boot.addr, "--identity",
               str(tmp / f"{name}.key"), "--http", "127.0.0.1:0", "--timeout", "10", "--drain-s", str(drain_s),
               "--served-model-name", "tiny"], tmp / f"{name}.log", env)
    base = next(w for w in bb.ready if w.startswith("http="))[5:]
    deadline = time.time() + 60
    while not httpx.get(base + "/v1/swarm", timeout=10).json()["workers"]:
        assert time.time() < deadline, bb.text()[-3000:]
        time.sleep(0.3)
    return bb, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), base


def _in_thread(fn) -> dict:
    """Run ``fn`` in a thread; the dict gets its 'result' or 'error', and 'done' (an Event)."""
    out: dict = {"done": threading.Event()}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:  # the test looks at what the client raised
            out["error"] = exc
        out["done"].set()

    threading.Thread(target=run, daemon=True).start()
    return out


def _stream(client, max_tokens: int, first: threading.Event):
    """Greedy: at the API's default temperature (1.0) the random-weight model samples its
    end-of-text token within 24 tokens about one run in fifteen, and the request ends early."""
    pieces, finish = [], None
    for chunk in client.completions.create(model="tiny", prompt="The swarm", max_tokens=max_tokens, stream=True,
                                           temperature=0):
        first.set()
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return pieces, finish


def test_sigterm_drains_running_requests_and_refuses_new_ones(slow_swarm):
    bb, client, base = _backbone(slow_swarm, "drain", drain_s=60)
    try:
        first = threading.Event()
        t0 = time.monotonic()
        running = _in_thread(lambda: _stream(client, 24, first))
        assert first.wait(60), bb.text()[-3000:]
        bb.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while httpx.get(base + "/health", timeout=10).json()["status"] != "draining":
            assert time.time() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model="tiny", prompt="late", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
        assert not running["done"].is_set(), "the request ended before the drain was seen: make it longer"
        assert running["done"].wait(60)
        assert "error" not in running, running.get("error")
        pieces, finish = running["result"]
        assert finish == "length" and "".join(pieces), running
        assert bb.proc.wait(30) == 0, bb.text()[-3000:]
        assert time.monotonic() - t0 < 60
    finally:
        bb.stop()


def test_requests_still_running_after_the_drain_are_cut_with_an_error(slow_swarm):
    bb, client, _base = _backbone(slow_swarm, "cut", drain_s=1)
    try:
        first = threading.Event()
        streamed = _in_thread(lambda: _stream(client, 400, first))
        whole = _in_thread(lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=400, temperature=0))
        assert first.wait(60), bb.text()[-3000:]
        time.sleep(0.5)  # the non-streamed one is generating too
        bb.proc.send_signal(signal.SIGTERM)
        assert streamed["done"].wait(30) and whole["done"].wait(30)
        err = streamed.get("error")
        assert isinstance(err, openai.APIError) and "shutting down" in err.message, streamed
        assert err.body and err.body.get("code") == "shutting_down", err.body
        err = whole.get("error")
        assert isinstance(err, openai.InternalServerError) and err.status_code == 503, whole
        assert "cut" in err.message, err.message
        assert bb.proc.wait(30) == 1, bb.text()[-3000:]
        log = bb.text()
        assert "cutting 2 requests" in log and "Traceback" not in log, log[-3000:]
    finally:
        bb.stop()
