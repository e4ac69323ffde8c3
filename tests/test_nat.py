"""NAT for real: a worker in its own network namespace behind a firewall that drops every inbound
new connection and lets out only WebSocket to the relay. The backbone (in the root namespace)
cannot dial it - asserted at the TCP and libp2p level - yet logits through it, via the relay,
are bit-equal to the monolithic run.

Needs root, ``ip`` (iproute2) and ``nft`` (nftables): ``python tests/system_tools.py`` installs them;
without them the tests fail with the line that says what to install (never skip).
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import trio
from conftest import run_cli
from helpers.netns import Netns
from helpers.procs import Proc, free_port, get_health, start_relay, worker_identity
from system_tools import require

from p2pswarm.errors import UserError
from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.tokens import issue_token

pytestmark = pytest.mark.slow
TOKENS = "5,17,42,99,100,7,256,300,12,64,128,31,2,77,500,9,33"




@pytest.fixture
def nat_netns():
    """A namespace joined to the root namespace by a veth pair (tests/helpers/netns.py), its
    firewall installed by the test once the relay's port is known. Removed even when the test fails."""
    require("ip", "nft")
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root: run the NAT tests as root", pytrace=False)
    ns = Netns(f"{os.getpid()}{random.randrange(10)}", net=random.randrange(0, 250), net_hi=231)
    try:
        ns.create()
    except RuntimeError as exc:
        ns.delete()
        pytest.fail(f"cannot create a network namespace here: {exc}", pytrace=False)
    try:
        yield ns
    finally:
        ns.delete()


def _tcp_reachable(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def test_natted_worker_serves_through_the_relay_only(nat_netns, tiny_f32, tmp_path):
    ns, host_ip, ns_ip = nat_netns.name, nat_netns.host_ip, nat_netns.ns_ip
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    issuer = Identity.generate()
    relay_port, worker_port = free_port(host_ip), random.randrange(20000, 30000)
    nat_netns.nat([(host_ip, relay_port)])
    relay = start_relay(tmp_path, env, issuer=issuer, port=relay_port, host=host_ip)
    worker = None
    try:
        shard = tmp_path / "shard.gguf"
        slice_experts(tiny_f32, shard, None, (0, 16))
        ident = worker_identity(tmp_path, "nat-worker")
        token = issue_token(issuer, ident.peer_id_str, ["relay"], 3600).encode()
        worker = Proc(["node", "--role", "worker", "--shard", str(shard), "--relay", relay.addr, "--token", token,
                       "--identity", str(tmp_path / "nat-worker.key"), "--listen", f"/ip4/{ns_ip}/tcp/{worker_port}",
                       "--ttl", "120"], tmp_path / "nat-worker.log", env, prefix=nat_netns.prefix)
        assert "/p2p-circuit/" in worker.addr and "/ws/" in worker.addr

        # the worker really listens (from inside its namespace) ...
        inside = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                 f"import socket; socket.create_connection(('{ns_ip}', {worker_port}), timeout=3)"],
                                capture_output=True, text=True, check=False)
        assert inside.returncode == 0, inside.stderr
        # ... yet nobody outside can open a connection to it, not even at the TCP level,
        assert not _tcp_reachable(ns_ip, worker_port)

        # ... nor dial it with libp2p
        async def direct_dial() -> str:
            async with open_host(Identity.generate()) as backbone:
                try:
                    await backbone.connect(f"/ip4/{ns_ip}/tcp/{worker_port}/p2p/{ident.peer_id_str}", timeout_s=5)
                except UserError as exc:
                    return str(exc)
                return "connected"

        assert trio.run(direct_dial) != "connected"
        # ... and the worker itself cannot reach anything but the relay's WebSocket port
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                              f"import socket; socket.create_connection(('{host_ip}', {free_port(host_ip)}), timeout=2)"],
                             capture_output=True, text=True, check=False)
        assert out.returncode != 0

        mono, swarm = tmp_path / "mono.npy", tmp_path / "swarm.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", "--decode",
                env=env, check=True)
        res = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(swarm), "--swarm", relay.addr,
                      "--kernel", "numpy", "--decode", env=env, check=True)
        assert " 0 fallbacks" in res.stdout, res.stdout
        assert int(res.stdout.split(" expert requests")[0].split()[-1]) > 0
        assert np.array_equal(np.load(mono), np.load(swarm))
        h = get_health(relay.health)
        assert h["reservations"] == 1 and h["circuits_opened"] >= 1 and h["bytes_relayed"] > 0
    finally:
        if worker is not None:
            worker.stop()
        relay.stop()


def test_natted_worker_with_no_file_downloads_its_slice_then_serves_it(nat_netns, tiny_f32, tmp_path):
    """A phone as it would join: no shard file, no inbound port, outbound WebSocket only (to the
    relay and to the backbone's WebSocket listener, as both would sit behind a CDN on 443). It finds
    the backbone's shard source through the DHT (via the relay), downloads only its slice, checks it
    against the signed manifest, then serves it through the relay: logits bit-equal, no fallback."""
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import build_manifest, source_fingerprint, write_manifest
    from p2pswarm.net.signed.tokens import shard_scope

    host_ip, ns_ip = nat_netns.host_ip, nat_netns.ns_ip
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    issuer = Identity.generate()
    fp = source_fingerprint(ModelLayout.open(tiny_f32))
    manifest = write_manifest(build_manifest(tiny_f32, issuer), tmp_path / "tiny.manifest")
    relay_port, backbone_port = free_port(host_ip), free_port(host_ip)
    nat_netns.nat([(host_ip, relay_port), (host_ip, backbone_port)])
    relay = start_relay(tmp_path, env, issuer=issuer, port=relay_port, host=host_ip)
    procs = [relay]
    try:
        backbone = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--manifest", str(manifest),
                         "--listen", f"/ip4/{host_ip}/tcp/{backbone_port}/ws", "--bootstrap", relay.addr,
                         "--http", "off", "--identity", str(tmp_path / "backbone.key")],
                        tmp_path / "backbone.log", env)
        procs.append(backbone)
        ident = worker_identity(tmp_path, "phone")
        token = issue_token(issuer, ident.peer_id_str, ["relay", shard_scope(fp, (0, 4), (0, 16))], 3600).encode()
        worker = Proc(["node", "--role", "worker", "--model", fp, "--layers", "0-3", "--experts", "0-15",
                       "--relay", relay.addr, "--token", token, "--trust-issuer", issuer.peer_id_str,
                       "--identity", str(tmp_path / "phone.key"), "--listen", f"/ip4/{ns_ip}/tcp/0", "--ttl", "120"],
                      tmp_path / "phone.log", env, prefix=nat_netns.prefix, timeout=180)
        procs.append(worker)
        assert "/p2p-circuit/" in worker.addr
        log = worker.log.read_text()
        assert "downloaded slice" in log, log[-3000:]
        downloaded = tmp_path / "home" / "shards" / f"{fp[:16]}-L0-3-E0-15.gguf"
        sliced = tmp_path / "sliced.gguf"
        slice_experts(tiny_f32, sliced, None, (0, 16))
        assert downloaded.read_bytes() == sliced.read_bytes()
        mono, swarm = tmp_path / "mono.npy", tmp_path / "swarm.npy"
        run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(mono), "--kernel", "numpy", env=env,
                check=True)
        res = run_cli("logits", str(tiny_f32), "--tokens", TOKENS, "--out", str(swarm), "--swarm", relay.addr,
                      "--kernel", "numpy", env=env, check=True)
        assert " 0 fallbacks" in res.stdout, res.stdout
        assert np.array_equal(np.load(mono), np.load(swarm))
    finally:
        for p in reversed(procs):
            p.stop()
