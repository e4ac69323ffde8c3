"""aarch64 against x86-64: the portable kernel gives the same bits, ggml does not and is refused.

The aarch64 side is a Debian bookworm arm64 root run under qemu-user (tests/helpers/arm64_root.py:
built on first use, ~12 min on a busy 2-core machine, then cached outside the repository at
$P2PSWARM_ARM64_ROOT or ~/.cache/p2pswarm-arm64). Needs root and the Debian packages
qemu-user-static, debootstrap, gcc/g++-aarch64-linux-gnu, cmake, ninja-build; without them these
tests fail with the line that says what to install (``python tests/system_tools.py`` installs them).

- every routed expert of three tiny models (F32, Q8_0, Q4_K_M = Q4_K + Q6_K) computed in the arm64
  root by the portable kernel (its aarch64 C build and its numpy implementation) equals, bit for
  bit, the portable kernel here;
- an aarch64 ``p2pswarm node --role worker --kernel portable`` serves the whole expert shard to
  an x86-64 ``p2pswarm logits --swarm`` backbone over libp2p: logits bit-equal to the x86-64
  monolithic run, prefill and decode; the same worker with the ggml kernel (libggml cross-compiled
  for aarch64) is left out by the backbone's DHT filter and refuses a direct handshake, with the
  reason, while the logits stay exact on the backbone's replica; yet it answers a request in the
  portable family (asked for in the hello) from an x86-64 ggml backbone bit for bit: how any
  worker can be verified.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import arm64_root as bed
from system_tools import require
from p2pswarm.engine import kernels

from conftest import run_cli

HELPERS = Path(__file__).parent / "helpers"
TOKENS = "5,17,42,99,100,7,256,300,12"  # prefill + 8 decode steps


@pytest.fixture(scope="module")
def arm64():
    """(root, staged project dir inside the root, libggml dir inside the root)."""
    require("qemu-aarch64-static", "debootstrap", "aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "cmake", "ninja")
    try:
        t0 = time.monotonic()
        root = bed.ensure_root()
        ggml = bed.ensure_libggml(root)
    except bed.TestBedError as exc:
        pytest.fail(f"aarch64 test bed unavailable: {exc}", pytrace=False)
    print(f"arm64 root ready in {time.monotonic() - t0:.0f} s")
    name = f"t-{uuid.uuid4().hex[:8]}"
    inside = bed.stage_project(root, name)
    (root / "opt" / name / "work").mkdir()
    shutil.copy2(HELPERS / "expert_outputs.py", root / "opt" / name / "expert_outputs.py")
    yield root, inside, ggml
    bed.unstage(root, name)


def _share(arm64, src: Path) -> str:
    """Hard-link (or copy) a file into the staged dir; returns its path inside the root."""
    root, inside, _ = arm64
    dest = root / inside.relative_to("/") / "work" / src.name
    if not dest.exists():
        try:
            os.link(src, dest)
        except OSError:
            shutil.copy2(src, dest)
    return str(inside / "work" / src.name)


@pytest.mark.slow
def test_portable_expert_outputs_are_bit_identical_on_aarch64(arm64, tiny_f32, tiny_q8, tiny_q4km, tmp_path):
    root, inside, _ = arm64
    rows = (np.random.default_rng(11).standard_normal((3, 256)) * 2).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    rows_in = _share(arm64, tmp_path / "rows.npy")
    host_dir = root / inside.relative_to("/") / "work"
    for model in (tiny_f32, tiny_q8, tiny_q4km):
        here = tmp_path / f"{model.stem}-x86.npz"
        subprocess.run([sys.executable, str(HELPERS / "expert_outputs.py"), str(model), str(tmp_path / "rows.npy"),
                        str(here), "--kernel", "portable", "--impl", "c"], check=True, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
        ref = np.load(here)
        model_in = _share(arm64, model)
        for impl, experts in (("c", 0), ("numpy", 2)):  # numpy under emulation is slow: 2 experts a layer
            out_name = f"{model.stem}-arm-{impl}.npz"
            r = bed.run_in_root(root, ["/usr/bin/python3", str(inside / "expert_outputs.py"), model_in, rows_in,
                                       str(inside / "work" / out_name), "--kernel", "portable", "--impl", impl,
                                       "--experts", str(experts)],
                                pythonpath=inside, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, r.stderr[-2000:]
            assert "portable-1/aarch64" in r.stdout, r.stdout
            got = np.load(host_dir / out_name)
            assert len(got.files) >= 8
            for key in got.files:
                assert np.array_equal(got[key].view(np.int32), ref[key].view(np.int32)), \
                    f"{model.name} {key} ({impl} on aarch64): max |diff| {np.abs(got[key] - ref[key]).max()}"
            print(f"{model.name}: {len(got.files)} expert outputs from aarch64 ({impl}) bit-identical; {r.stdout.strip()}")


def RootNode(arm64, args: list[str], log: Path, env: dict) -> bed.RootProcess:
    """A ``p2pswarm node`` inside the arm64 root (``.where`` is its READY address)."""
    root, inside, _ = arm64
    return bed.RootProcess(root, inside, args, env=env, log=log)


async def _portable_request(boot_addr: str, model: Path, worker_kernel: str):
    """As an x86-64 ggml backbone: ask the worker for portable answers (hello ``family``) and
    compute the same request with our portable kernel; (theirs, ours, the worker's families)."""
    from p2pswarm.backbone.owners.libp2p_owner import Libp2pOwner
    from p2pswarm.engine.ggml import lib as gk
    from p2pswarm.engine.experts import portable_kernel as pk
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.dht.coverage import CoverageResolver
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity
    from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

    layout = ModelLayout.open(model)
    fp = model_fingerprint(layout)
    rows = (np.random.default_rng(29).standard_normal((4, 256)) * 2).astype(np.float32)
    groups = [(0, np.array([0, 3])), (5, np.arange(4)), (15, np.array([2]))]
    layer = layout.expert_layers[-1]
    want = pk.PortableExpertBank(layout, threads=1).forward_groups(layer, rows, groups)
    async with open_host(Identity.generate()) as net, open_dht(net, server=False, bootstrap=[boot_addr]) as dht:
        resolver = CoverageResolver(dht, model=fp, layers=layout.expert_layers, n_expert=layout.n_expert,
                                    block_size=DEFAULT_BLOCK_SIZE, protocol=proto.PROTOCOL_VERSION,
                                    kernel=worker_kernel)
        owners = list((await resolver.refresh()).peers().values())
        assert len(owners) == 1, owners
        owner = Libp2pOwner(net, owners[0], model_fingerprint=fp, kernel=gk.load_libggml().kernel_id,
                            timeout_s=120, family=pk.FAMILY)
        try:
            got = await owner.compute(layer, rows, groups)
        finally:
            await owner.aclose()
    return got, want, owner.families


def _swarm_logits(model, boot_addr: str, out: Path, env: dict, decode: bool):
    flag = ["--decode"] if decode else []
    return run_cli("logits", str(model), "--tokens", TOKENS, "--out", str(out), "--swarm", boot_addr,
                   "--kernel", "portable", "--timeout", "120", *flag, env=env, timeout=900, check=True)


async def _direct_handshake(boot_addr: str, model: Path, worker_kernel: str) -> str:
    """Dial the worker as a portable backbone would if the DHT filter let it through; the error."""
    from p2pswarm.backbone.owners.libp2p_owner import Libp2pOwner
    from p2pswarm.engine.experts import portable_kernel as pk
    from p2pswarm.errors import WorkerError
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.dht.coverage import CoverageResolver
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity
    from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

    layout = ModelLayout.open(model)
    fp = model_fingerprint(layout)
    async with open_host(Identity.generate()) as net, open_dht(net, server=False, bootstrap=[boot_addr]) as dht:
        resolver = CoverageResolver(dht, model=fp, layers=layout.expert_layers, n_expert=layout.n_expert,
                                    block_size=DEFAULT_BLOCK_SIZE, protocol=proto.PROTOCOL_VERSION,
                                    kernel=worker_kernel)  # see it: ask for its own kernel
        cmap = await resolver.refresh()
        owners = list(cmap.peers().values())
        assert len(owners) == 1, owners
        owner = Libp2pOwner(net, owners[0], model_fingerprint=fp, kernel=pk.kernel_id(), timeout_s=60)
        try:
            await owner.compute(layout.expert_layers[0], np.ones((1, 256), np.float32), [(0, np.arange(1))])
        except WorkerError as exc:
            return str(exc)
        finally:
            await owner.aclose()
    raise AssertionError("the ggml worker accepted a portable backbone")


@pytest.mark.slow
def test_aarch64_worker_serves_x86_backbone_bit_exact_and_ggml_worker_is_refused(arm64, tiny_q4km, tmp_path):
    import trio

    from p2pswarm.model.slicer import slice_experts

    root, inside, ggml = arm64
    model = tiny_q4km
    shard = tmp_path / "all-experts.gguf"
    slice_experts(model, shard, None, (0, 16))
    shard_in = _share(arm64, shard)
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"), P2PSWARM_THREADS="1")
    from helpers.procs import Proc

    boot = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / "boot.key")],
                tmp_path / "boot.log", env)
    nodes = [boot]
    try:
        mono = {}
        for decode in (False, True):
            out = tmp_path / f"mono{decode}.npy"
            run_cli("logits", str(model), "--tokens", TOKENS, "--out", str(out), "--kernel", "portable",
                    *(["--decode"] if decode else []), env=env, check=True)
            mono[decode] = np.load(out)
        root_env = {"P2PSWARM_HOME": "/root/p2pswarm-home", "P2PSWARM_LOG_LEVEL": "DEBUG", "P2PSWARM_THREADS": "1"}
        worker = RootNode(arm64, ["node", "--role", "worker", "--shard", shard_in, "--bootstrap", boot.addr,
                                  "--identity", str(inside / "work" / "w.key"), "--kernel", "portable",
                                  "--ttl", "300"], tmp_path / "arm-portable.log", root_env)
        nodes.append(worker)
        status = run_cli("swarm-status", "--bootstrap", boot.addr, "--model", str(model), "--kernel", "portable",
                         "--json", env=env, check=True)
        (seen,) = json.loads(status.stdout.strip().splitlines()[-1])["peers"].values()
        assert (seen["status"], seen["kernel"], seen["family"], seen["answers_in"]) == \
            ("live", "portable-1/aarch64", "portable-1", ["portable-1"]), seen
        for decode in (False, True):
            out = tmp_path / f"swarm{decode}.npy"
            t0 = time.monotonic()
            proc = _swarm_logits(model, boot.addr, out, env, decode)
            requests = int(proc.stdout.split(" expert requests")[0].split()[-1])
            print(f"aarch64 portable worker, decode={decode}: {requests} expert requests in "
                  f"{time.monotonic() - t0:.1f} s; {proc.stdout.strip().splitlines()[-1]}")
            assert requests > 0 and " 0 fallbacks" in proc.stdout, proc.stdout
            assert np.array_equal(np.load(out), mono[decode]), f"decode={decode}: aarch64 worker changed the logits"
        assert worker.stop() == 0
        log = worker.log.read_text()
        assert "portable-1/aarch64" in log and "Traceback" not in log, log[-2000:]
        nodes.remove(worker)

        # The same worker with the ggml kernel: ggml-<ver>/aarch64+neon+dotprod, another family.
        genv = dict(root_env, P2PSWARM_GGML_LIB=str(ggml))
        gworker = RootNode(arm64, ["node", "--role", "worker", "--shard", shard_in, "--bootstrap", boot.addr,
                                   "--identity", str(inside / "work" / "w.key"), "--kernel", "ggml", "--ttl", "300"],
                           tmp_path / "arm-ggml.log", genv)
        nodes.append(gworker)
        glog = gworker.log.read_text()
        ggml_id = next(w for w in glog.split() if w.startswith("ggml-") and "/aarch64" in w)
        out = tmp_path / "swarm-ggml.npy"
        proc = _swarm_logits(model, boot.addr, out, env, decode=True)
        assert " 0 expert requests" in proc.stdout, proc.stdout  # the DHT filter never dialled it
        assert np.array_equal(np.load(out), mono[True])  # the backbone's portable replica computed all
        why = trio.run(_direct_handshake, boot.addr, model, ggml_id)
        print(f"aarch64 ggml worker ({ggml_id}): {why}")
        assert "refused the handshake: kernel mismatch" in why and ggml_id in why and "portable-1/x86_64" in why
        # ... but it answers portably on request: an x86-64 ggml backbone verifying it bit for bit
        got, want, families = trio.run(_portable_request, boot.addr, model, ggml_id)
        assert families == (kernels.family(ggml_id), "portable-1"), families
        for a, b in zip(got, want):
            assert np.array_equal(a.view(np.int32), b.view(np.int32)), "aarch64 portable answer differs"
        print(f"aarch64 ggml worker answered a portable request from an x86-64 ggml backbone: "
              f"{sum(len(a) for a in got)} rows bit-equal")
        assert gworker.stop() == 0
        assert "at handshake: kernel mismatch" in gworker.log.read_text()
    finally:
        for n in reversed(nodes):
            n.stop()
