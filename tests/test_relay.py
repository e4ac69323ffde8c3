"""relay-443 as real OS processes over real sockets: a `p2pswarm relay` process, relayed worker
processes (`node --role worker --relay ... --token ...`) and backbones (`logits --swarm`).

* frames of every awkward size cross the relay intact;
* logits through a relayed worker are bit-equal to the monolithic run;
* forged, expired, someone else's, wrong-scope and missing tokens are refused, logged with their
  reason, counted on the health endpoint, and get no reservation;
* a relay killed with SIGKILL mid-generation: the generation falls back and stays exact, the relay
  comes back on the same port and identity, and the worker re-reserves and is used again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import assert_one_line_error, run_cli

from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.wire.framing import FrameReader, send_frame
from p2pswarm.net.libp2p.addrs import circuit_addr
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity, load_or_create_identity
from p2pswarm.net.signed.tokens import NodeToken, issue_token
from p2pswarm.net.libp2p.relay_client import RelayKeeper

from helpers.procs import (
    Proc, assert_swarm_logits_exact, free_port, get_health, start_relay, worker_args, worker_identity,
)

TOKENS = "5,17,42,99,100,7,256,300,12,64,128,31,2,77,500,9,33"
FRAME_SIZES = [0, 1, 65535, 65536, 65537, 16 << 20, 64 << 20]


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")


@pytest.fixture
def issuer(tmp_path):
    return load_or_create_identity(tmp_path / "issuer.key")



# -- (a) frames --------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_frames_of_every_size_cross_the_relay_intact(tmp_path, env):
    """0, 1, 65535, 65536, 65537 bytes, 16 MiB and 64 MiB, both ways, through a relay process."""
    relay = await trio.to_thread.run_sync(lambda: start_relay(tmp_path, env))
    try:
        async with open_host(Identity.generate()) as worker, open_host(Identity.generate()) as backbone:
            await RelayKeeper(worker, relay.addr, None).start()

            async def echo(stream) -> None:
                reader = FrameReader(stream, 1 << 27)
                while (frame := await reader.read_frame()) is not None:
                    await send_frame(stream, frame, 1 << 27)

            worker.set_handler("/test/echo/1.0.0", echo)
            stream = await backbone.open_stream(circuit_addr(relay.addr, worker.peer_id_str), "/test/echo/1.0.0")
            reader = FrameReader(stream, 1 << 27)
            rng = np.random.default_rng(7)
            for n in FRAME_SIZES:
                data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
                t0 = time.perf_counter()
                await send_frame(stream, data, 1 << 27)
                got = await reader.read_frame()
                print(f"{n} bytes round trip through the relay: {time.perf_counter() - t0:.3f} s")
                assert got is not None and len(got) == n and got == data, n
        h = get_health(relay.health)
        assert h["circuits_opened"] == 1 and h["bytes_relayed"] > 2 * (80 << 20)
    finally:
        relay.stop()
    assert relay.proc.returncode == 0, relay.text()[-2000:]
    assert "Traceback" not in relay.text()


# -- (b) logits through a relayed worker ------------------------------------------------------------
@pytest.mark.slow
def test_logits_through_a_relayed_worker_equal_monolithic(tiny_f32, tmp_path, env, issuer):
    relay = start_relay(tmp_path, env, issuer=issuer)
    worker = None
    try:
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        ident = worker_identity(tmp_path, "w0")
        token = issue_token(issuer, ident.peer_id_str, ["relay"], 3600).encode()
        worker = Proc(worker_args(tmp_path, shard, relay.addr, "w0", token), tmp_path / "w0.log", env)
        assert worker.addr == circuit_addr(relay.addr, ident.peer_id_str)
        assert "relayed, DHT client" in worker.text()
        h = get_health(relay.health)
        assert h["reservations"] == 1 and h["tokens_accepted"] == 1 and h["refusals"] == {}
        for decode in (False, True):
            assert_swarm_logits_exact(tiny_f32, TOKENS, relay.addr, tmp_path, env, decode=decode)
        h = get_health(relay.health)
        assert h["circuits_opened"] >= 2 and h["bytes_relayed"] > 0
        assert worker.stop() == 0
        assert "withdrew my records" in worker.text()
    finally:
        if worker is not None:
            worker.stop()
        relay.stop()


# -- (c) token refusals -------------------------------------------------------------------------------
def _forged(token: str) -> str:
    tok = NodeToken.decode(token)
    sig = bytearray(tok.signature)
    sig[5] ^= 0x01
    return NodeToken(**{**tok.__dict__, "signature": bytes(sig)}).encode()


@pytest.mark.slow
def test_bad_tokens_get_no_reservation(tiny_f32, tmp_path, env, issuer):
    relay = start_relay(tmp_path, env, issuer=issuer)
    try:
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        me = worker_identity(tmp_path, "w")
        someone = Identity.generate().peer_id_str
        cases = {
            "bad signature": _forged(issue_token(issuer, me.peer_id_str, ["relay"], 3600).encode()),
            "expired": issue_token(issuer, me.peer_id_str, ["relay"], 3600, now=time.time() - 7200).encode(),
            "wrong holder": issue_token(issuer, someone, ["relay"], 3600).encode(),
            "wrong scope": issue_token(issuer, me.peer_id_str, ["shard"], 3600).encode(),
            "untrusted issuer": issue_token(Identity.generate(), me.peer_id_str, ["relay"], 3600).encode(),
            "no token": None,
        }
        for reason, token in cases.items():
            p = Proc(worker_args(tmp_path, shard, relay.addr, "w", token), tmp_path / f"w-{reason}.log",
                     {**env, "P2PSWARM_LOG_LEVEL": "WARNING"}, expect_ready=False)
            p.proc.wait(90)
            out = p.proc.stdout.read()
            proc = subprocess.CompletedProcess(p.proc.args, p.proc.returncode, out, p.text())
            assert_one_line_error(proc, "relay refused")
            assert "READY" not in out
            h = get_health(relay.health)
            assert h["refusals"].get(reason) == 1, (reason, h["refusals"])
            assert h["reservations"] == 0 and h["reservations_granted"] == 0, h
        log = relay.text()
        for needle in ("signature does not verify", "expired", "not the connecting peer", "does not allow 'relay'",
                       "is not trusted", "no token presented"):
            assert needle in log, needle
        # and the good token still works afterwards
        good = issue_token(issuer, me.peer_id_str, ["relay"], 3600).encode()
        w = Proc(worker_args(tmp_path, shard, relay.addr, "w", good), tmp_path / "w-good.log", env)
        h = get_health(relay.health)
        assert h["reservations"] == 1
        # /metrics on the health port: the same numbers, in Prometheus text format
        with urllib.request.urlopen(relay.health.replace("/health", "/metrics"), timeout=10) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert {s.labels["reason"]: s.value for s in fams["p2pswarm_relay_refusals"].samples} == dict.fromkeys(cases, 1)
        assert fams["p2pswarm_relay_reservations"].samples[0].value == 1
        assert fams["p2pswarm_relay_tokens_accepted"].samples[0].value == h["tokens_accepted"] == 1
        w.stop()
    finally:
        relay.stop()


# -- (d) relay restart -----------------------------------------------------------------------------
@pytest.mark.slow
def test_relay_restart_mid_generation(tiny_f32, tmp_path, env, issuer):
    port = free_port()
    relay = start_relay(tmp_path, env, issuer=issuer, port=port)
    worker = gen = None
    try:
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        ident = worker_identity(tmp_path, "w0")
        token = issue_token(issuer, ident.peer_id_str, ["relay"], 3600).encode()
        worker = Proc(worker_args(tmp_path, shard, relay.addr, "w0", token), tmp_path / "w0.log", env)
        tokens = ",".join(str((i * 37) % 500 + 1) for i in range(120))
        mono = tmp_path / "mono.npy"
        run_cli("logits", str(tiny_f32), "--tokens", tokens, "--out", str(mono), "--kernel", "numpy", "--decode",
                env=env, check=True)
        out = tmp_path / "swarm.npy"
        gen = subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", "logits", str(tiny_f32), "--tokens", tokens,
                                "--out", str(out), "--swarm", relay.addr, "--kernel", "numpy", "--decode",
                                "--timeout", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.time() + 60
        while get_health(relay.health)["bytes_relayed"] < 200_000:  # the generation is using the worker
            assert time.time() < deadline and gen.poll() is None, "the generation never used the relayed worker"
            time.sleep(0.02)
        relay.stop(signal.SIGKILL)
        stdout, stderr = gen.communicate(timeout=240)
        assert gen.returncode == 0, stderr
        assert "Traceback" not in stderr
        fallbacks = int(stdout.split(" fallbacks")[0].split()[-1])
        print(stdout.strip())
        assert fallbacks > 0, stdout  # it was in flight: the rest ran on the local replica
        assert np.array_equal(np.load(mono), np.load(out))
        # the relay comes back on the same port and identity; the worker re-reserves by itself
        relay = start_relay(tmp_path, env, issuer=issuer, port=port)
        worker.wait_log("re-reserved on relay", timeout=60)
        worker.wait_log("re-published my records", timeout=60)
        print([ln for ln in worker.text().splitlines() if "re-reserved" in ln or "lost the connection" in ln])
        assert get_health(relay.health)["reservations"] == 1
        short = tmp_path / "after.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(tmp_path / "mono2.npy"), "--kernel",
                "numpy", "--decode", env=env, check=True)
        proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(short), "--swarm", relay.addr,
                       "--kernel", "numpy", "--decode", env=env, check=True)
        assert " 0 fallbacks" in proc.stdout and np.array_equal(np.load(tmp_path / "mono2.npy"), np.load(short))
        assert int(proc.stdout.split(" expert requests")[0].split()[-1]) > 0
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
        if worker is not None:
            worker.stop()
        relay.stop()


# -- bad input: one line, non-zero exit -------------------------------------------------------------
@pytest.mark.slow
def test_relay_cli_errors(tmp_path, env):
    proc = run_cli("relay", "--listen", "/ip4/127.0.0.1/tcp/0/ws", env=env)
    assert_one_line_error(proc, "--trust-issuer", "--open")
    proc = run_cli("relay", "--listen", "not-a-multiaddr", "--open", env=env)
    assert_one_line_error(proc, "bad listen address")
    proc = run_cli("relay", "--listen", "/ip4/127.0.0.1/tcp/0/wss", "--open", env=env)
    assert_one_line_error(proc, "TLS certificate")
    proc = run_cli("relay", "--trust-issuer", "nonsense", env=env)
    assert_one_line_error(proc, "not an Ed25519 peer id")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_reservations = [\n")
    assert_one_line_error(run_cli("relay", "--config", str(bad), "--open", env=env), "not valid TOML")
    bad.write_text("[relay]\nmax_reservatons = 5\n")
    assert_one_line_error(run_cli("relay", "--config", str(bad), "--open", env=env), "unknown setting")
    bad.write_text("[relay]\nmax_reservations = -1\nopen = true\n")
    assert_one_line_error(run_cli("relay", "--config", str(bad), env=env), "max_reservations")
    proc = run_cli("relay", "--open", "--health", "nope", env=env)
    assert_one_line_error(proc, "health")


@pytest.mark.slow
def test_worker_relay_errors(tiny_f32, tmp_path, env):
    shard = tmp_path / "shard.gguf"
    slice_experts(tiny_f32, shard, None, (0, 16))
    proc = run_cli("node", "--role", "worker", "--shard", str(shard), "--relay", "/ip4/1.2.3.4/tcp/1/ws", env=env)
    assert_one_line_error(proc, "/p2p/")
    proc = run_cli("node", "--role", "worker", "--shard", str(shard), "--relay", "garbage", env=env)
    assert_one_line_error(proc, "bad peer address")
    pid = Identity.generate().peer_id_str
    proc = run_cli("node", "--role", "worker", "--shard", str(shard), "--relay",
                   f"/ip4/127.0.0.1/tcp/{free_port()}/ws/p2p/{pid}", "--token", str(tmp_path / "missing"), env=env)
    assert_one_line_error(proc, "token")
    proc = run_cli("node", "--role", "worker", "--shard", str(shard), "--relay",
                   f"/ip4/127.0.0.1/tcp/{free_port()}/ws/p2p/{pid}", env={**env, "P2PSWARM_LOG_LEVEL": "WARNING"},
                   timeout=120)
    assert_one_line_error(proc, "cannot dial")


def test_relay_config_file(tmp_path):
    from p2pswarm.relay.config import load_settings

    cfg = tmp_path / "relay.toml"
    cfg.write_text('[relay]\nlisten = "/ip4/0.0.0.0/tcp/8080/ws"\nopen = true\nmax-reservations = 50\n'
                   'max_circuit_bytes = 1000\n')
    s = load_settings(str(cfg), {"max_circuits": 77, "listen": None})
    assert (s.listen, s.max_reservations, s.max_circuits, s.max_circuit_bytes) == (
        ["/ip4/0.0.0.0/tcp/8080/ws"], 50, 77, 1000)
    assert s.max_circuits_per_peer == 256 and s.reservation_ttl == 3600


@pytest.mark.slow
def test_wss_relay_direct_deployment(tiny_f32, tmp_path, env, issuer):
    """The direct deployment: the relay terminates TLS itself on /wss (plus /ws for a CDN, on
    another port); the worker reserves over /wss and the backbone reaches it through /wss."""
    from helpers.tls import make_cert

    cert, key = make_cert(tmp_path)
    env = {**env, "P2PSWARM_WSS_CA": cert}
    wss, ws = free_port(), free_port()
    relay = start_relay(tmp_path, env, issuer=issuer, port=ws,
                        extra=["--listen", f"/ip4/127.0.0.1/tcp/{wss}/wss", "--tls-cert", cert, "--tls-key", key])
    worker = None
    try:
        h = get_health(relay.health)
        wss_addr = next(a for a in h["addrs"] if "/wss/" in a)
        assert any("/ws/" in a for a in h["addrs"])
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        ident = worker_identity(tmp_path, "w0")
        token = issue_token(issuer, ident.peer_id_str, ["relay"], 3600).encode()
        worker = Proc(worker_args(tmp_path, shard, wss_addr, "w0", token), tmp_path / "w0.log", env)
        assert "/wss/" in worker.addr
        mono, swarm = tmp_path / "mono.npy", tmp_path / "swarm.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", env=env,
                check=True)
        proc = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(swarm), "--swarm", wss_addr,
                       "--kernel", "numpy", env=env, check=True)
        assert " 0 fallbacks" in proc.stdout, proc.stdout
        assert np.array_equal(np.load(mono), np.load(swarm))
    finally:
        if worker is not None:
            worker.stop()
        relay.stop()
