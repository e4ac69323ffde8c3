"""libggml as ``pip install`` builds it (native/build_ggml.py) and the kernel uses it.

- the package ships it (p2pswarm/_native/) and load_libggml() loads that copy, not llama-cpp-python's;
- its kernel id equals the one llama-cpp-python's libggml yields (same ggml 0.25.3 source), and the
  two compute the same bits (1, 8 and 64 rows; Q8_0 and Q4_K_M; llama.cpp's quantiser too), so the
  id's promise holds;
- in one process with llama-cpp-python's copy, neither library binds a symbol to the other (the
  dynamic loader's own account, LD_DEBUG=bindings with every symbol bound at load);
- with nothing said, the backbone, its worker processes and a `p2pswarm worker` compute with ggml.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import p2pswarm
from p2pswarm.backbone.sessions.local import WorkerProcess, ensure_shards, open_backbone
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine import kernels
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.worker.expert_worker import ExpertWorker

from conftest import needs_llama
from p2pswarm.backbone.serving.generate import sequence_logits

NATIVE = Path(p2pswarm.__file__).resolve().parent / "_native"
ROOT = Path(p2pswarm.__file__).resolve().parents[1]
GGML_VERSION, GGML_COMMIT = "0.25.3", "0c1e570"  # what llama-cpp-python 0.3.36 vendors


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (gk.ENV_LIB, gk.ENV_DISABLE, kernels.ENV_KERNEL)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _llama_cpp_lib() -> Path:
    import importlib.util

    return Path(list(importlib.util.find_spec("llama_cpp").submodule_search_locations)[0]) / "lib"


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for var in (gk.ENV_LIB, gk.ENV_DISABLE, kernels.ENV_KERNEL):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("P2PSWARM_THREADS", "1")


def test_the_package_ships_libggml_and_loads_it_first():
    missing = [n for n in ("libp2pswarm-ggml-base.so", "libp2pswarm-ggml-cpu.so") if not (NATIVE / n).is_file()]
    assert not missing, (f"{NATIVE} has no {missing}: pip install builds it; from a source tree run "
                         f"`python {ROOT / 'native' / 'build_ggml.py'}`")
    script = ("import json; from p2pswarm.engine.ggml import lib as gk; lib = gk.load_libggml(); "
              "print(json.dumps({'origin': lib.origin, 'paths': {k: str(v) for k, v in lib.paths.items()}, "
              "'version': lib.ggml_version, 'commit': lib.ggml_commit, 'id': lib.kernel_id, "
              "'maps': open('/proc/self/maps').read()}))")
    got = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    env=_env(), timeout=120).stdout)
    assert got["origin"] == "p2pswarm"
    assert got["paths"] == {"base": str(NATIVE / "libp2pswarm-ggml-base.so"),
                            "cpu": str(NATIVE / "libp2pswarm-ggml-cpu.so")}
    assert (got["version"], got["commit"]) == (GGML_VERSION, GGML_COMMIT)
    assert got["id"].startswith(f"ggml-{GGML_VERSION}-{GGML_COMMIT}/") and "+llamafile" in got["id"]
    # the process mapped our copy and no other libggml (llama-cpp-python installed or not)
    mapped = {line.split()[-1] for line in got["maps"].splitlines() if "ggml" in line.split()[-1]}
    assert mapped == set(got["paths"].values()), mapped


def test_the_fallback_says_how_to_get_ggml(tmp_path, monkeypatch):
    """A checkout run with PYTHONPATH and never built: the reason names the command that builds it."""
    monkeypatch.setattr(gk, "NATIVE_DIR", tmp_path / "_native")
    monkeypatch.setattr(gk.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gk.GgmlUnavailable) as err:
        gk._locate()
    msg = str(err.value)
    assert f"python {ROOT / 'native' / 'build_ggml.py'}" in msg and f"pip install -e {ROOT}" in msg, msg


@pytest.mark.slow
def test_a_missing_compiler_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "native" / "build_ggml.py"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env=_env(CC="no-such-cc", P2PSWARM_GGML_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a C and a C++ compiler" in lines[0] and "no-such-cc" in lines[0], lines
    assert "build-essential" in lines[0] and "P2PSWARM_GGML_BUILD=off" in lines[0]
    assert not (tmp_path / "out").exists()


_SAME_BITS = r"""
import json, sys
import numpy as np
from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine.experts import ggml_bank as ggml_experts
from p2pswarm.model.layout import ModelLayout
lib = gk.load_libggml()
out = {}
rng = np.random.default_rng(5)
for i, path in enumerate(sys.argv[2:]):
    bank = ggml_experts.GgmlExpertBank(ModelLayout.open(path), threads=1)
    x = rng.standard_normal((64, bank.n_embd)).astype(np.float32)
    for n in (1, 8, 64):
        out[f"m{i}_{n}"] = bank.forward(1, 5, x[:n])
    out[f"m{i}_groups"] = np.concatenate(bank.forward_groups(2, x, [(0, np.arange(9)), (7, np.arange(9, 64))]))
w = rng.standard_normal((16, 512)).astype(np.float32)
for qtype in (8, 12, 14):  # Q8_0, Q4_K, Q6_K by llama.cpp's quantiser
    out[f"quant{qtype}"] = gk.quantize(qtype, w, lib)
np.savez(sys.argv[1], **out)
print(json.dumps({"id": lib.kernel_id, "origin": lib.origin, "base": str(lib.paths["base"])}))
"""


@needs_llama
@pytest.mark.slow
def test_kernel_id_and_bits_match_llama_cpp_pythons_libggml(tiny_q8, tiny_q4km, tmp_path):
    runs = {}
    for who, extra in (("ours", {}), ("llama-cpp-python", {gk.ENV_LIB: str(_llama_cpp_lib())})):
        out = tmp_path / f"{who}.npz"
        proc = subprocess.run([sys.executable, "-c", _SAME_BITS, str(out), str(tiny_q8), str(tiny_q4km)],
                              capture_output=True, text=True, env=_env(**extra), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[who] = (json.loads(proc.stdout), dict(np.load(out)))
    (ours, ours_out), (theirs, theirs_out) = runs["ours"], runs["llama-cpp-python"]
    assert ours["origin"] == "p2pswarm" and ours["base"].startswith(str(NATIVE))
    assert theirs["base"].startswith(str(_llama_cpp_lib()))
    assert ours["id"] == theirs["id"], (ours["id"], theirs["id"])
    assert ours_out.keys() == theirs_out.keys()
    for key in ours_out:
        assert ours_out[key].tobytes() == theirs_out[key].tobytes(), key


_BINDINGS = r"""
import ctypes, importlib.util, sys
from pathlib import Path
if sys.argv[1] == "llama-global":  # as a loader that shares llama.cpp's libggml process-wide would
    lib = Path(list(importlib.util.find_spec("llama_cpp").submodule_search_locations)[0]) / "lib"
    for name in ("libggml-base.so", "libggml-cpu.so"):
        ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
if sys.argv[1] != "ours-first":
    import llama_cpp
from p2pswarm.engine.ggml import lib as gk
lib = gk.load_libggml()
if sys.argv[1] == "ours-first":
    import llama_cpp
assert lib.origin == "p2pswarm", lib.origin
print(lib.kernel_id)
"""


@needs_llama
@pytest.mark.parametrize("order", ["llama-first", "llama-global", "ours-first"])
@pytest.mark.slow
def test_our_libggml_and_llama_cpps_never_bind_to_each_other(order, tmp_path):
    """llama.cpp's libggml loaded before ours (as llama-cpp-python does, RTLD_LOCAL; or RTLD_GLOBAL,
    as another loader might) or after: ours must neither take its symbols nor lend it ours. LD_BIND_NOW makes the loader resolve every symbol at load, LD_DEBUG lists each binding;
    every ggml/gguf symbol of either copy must resolve within that copy."""
    log = tmp_path / "ld"
    proc = subprocess.run([sys.executable, "-c", _BINDINGS, order], capture_output=True, text=True, timeout=120,
                          env=_env(LD_BIND_NOW="1", LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = str(_llama_cpp_lib())
    binding = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)'")
    seen = {"ours->ours": 0, "theirs->theirs": 0}
    for f in tmp_path.glob("ld.*"):
        for line in f.read_text(errors="replace").splitlines():
            if "ggml" not in line:
                continue
            m = binding.search(line)
            if not m:
                continue
            src, dst, sym = m.groups()
            if "ggml" not in sym and "gguf" not in sym:
                # C++ standard-library template data (e.g. std::__to_chars' digit table) is GNU_UNIQUE:
                # one copy per process by the C++ ABI, identical bytes from libstdc++'s headers.
                continue
            src_ours, dst_ours = "libp2pswarm-ggml-" in src, "libp2pswarm-ggml-" in dst
            src_theirs, dst_theirs = src.startswith(theirs), dst.startswith(theirs)
            assert not (src_ours and dst_theirs), f"our {src} took {sym} from llama.cpp's {dst}"
            assert not (src_theirs and dst_ours), f"llama.cpp's {src} took {sym} from our {dst}"
            if src_ours and dst_ours:
                seen["ours->ours"] += 1
            if src_theirs and dst_theirs:
                seen["theirs->theirs"] += 1
    # both copies were really loaded and bound their ggml symbols, each within itself
    assert seen["ours->ours"] > 50 and seen["theirs->theirs"] > 50, seen


@pytest.mark.slow
async def test_backbone_and_workers_default_to_ggml(tiny_q8, tmp_path):
    ggml_id = gk.load_libggml().kernel_id
    assert kernels.default_kernel() == "auto" and kernels.resolve_kernel() == "ggml"
    layout = ModelLayout.open(tiny_q8)
    shard = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)[0]
    assert ExpertWorker(shard).info.kernel == ggml_id
    # a `p2pswarm worker` started with no --kernel computes for a ggml backbone (a numpy one would be
    # refused with "kernel mismatch")
    info = ExpertWorker.describe_shard(shard, "numpy")
    wp = WorkerProcess.start(shard)
    try:
        owner = SocketOwner("w", wp.host, wp.port, model_fingerprint=model_fingerprint(layout), kernel=ggml_id,
                            layers=(info.layer_begin, info.layer_end), experts=(info.expert_begin, info.expert_end))
        out = await owner.compute(info.layer_begin, np.ones((2, 256), np.float32), [(info.expert_begin, np.arange(2))])
        assert out[0].shape == (2, 256)
        await owner.aclose()
    finally:
        wp.stop()
    async with open_backbone(tiny_q8, workers=2, transport="socket") as swarm:
        assert swarm.backbone.dispatcher.local.bank.kernel == ggml_id
        await sequence_logits(swarm.backbone, [1, 2, 3, 4])
        assert swarm.backbone.dispatcher.stats.fallbacks == 0  # both worker processes accepted ggml



@pytest.mark.slow
def test_build_log_is_kept_in_the_cache_only_on_failure(tmp_path, monkeypatch):
    """A build step's log lives in the build's temporary folder; only a failure copies it into the
    cache folder (never to a fixed /tmp path), and the error line names that copy."""
    sys.path.insert(0, str(ROOT / "native"))
    try:
        import build_ggml
    finally:
        sys.path.remove(str(ROOT / "native"))
    cache = tmp_path / "cache"
    monkeypatch.setenv(build_ggml.ENV_CACHE, str(cache))
    log = tmp_path / "work" / "build.log"
    log.parent.mkdir()
    build_ggml._run_logged([sys.executable, "-c", "print('[1/1] fine')"], log, "a good step", dict(os.environ))
    assert not (cache / build_ggml.FAILED_LOG).exists()
    with pytest.raises(build_ggml.BuildError) as err:
        build_ggml._run_logged([sys.executable, "-c", "print('foo.c:1: error: boom'); raise SystemExit(3)"], log,
                               "a bad step", dict(os.environ))
    kept = cache / build_ggml.FAILED_LOG
    assert f"full log: {kept}" in str(err.value) and "error: boom" in str(err.value), err.value
    assert "error: boom" in kept.read_text() and "fine" in kept.read_text()
