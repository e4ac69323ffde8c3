"""An aarch64 test bed on an x86-64 machine: a Debian arm64 root run under qemu-user.

Why: every phone is aarch64, and "bit-identical on x86-64 and aarch64" is a claim only an aarch64
CPU (here: qemu's emulation of one, which implements the ISA's IEEE arithmetic exactly) can check.

    python tests/helpers/arm64_root.py            # build (or reuse) the root, print its path
    python tests/helpers/arm64_root.py --check    # and run numpy + p2pswarm's imports in it

What it does, each step skipped when already done:

1. registers qemu's aarch64 binfmt handler (``/usr/lib/binfmt.d/qemu-aarch64.conf`` written to
   ``/proc/sys/fs/binfmt_misc/register``, binfmt_misc mounted first if needed). Its ``F`` flag opens
   the interpreter at registration, so a chroot needs no qemu binary inside;
2. ``debootstrap --arch=arm64 --variant=minbase --include=python3 bookworm ROOT`` (~2-4 min);
3. the project's Python deps, at the versions installed here (so the pins of pyproject.toml), as
   PyPI's manylinux aarch64 wheels, installed by the *host's* pip with ``--platform`` into the root's
   dist-packages: no pip and no emulated work inside the root (``WHEELS`` lists them);
4. the portable kernel's C file, cross-compiled by ``aarch64-linux-gnu-gcc`` (see
   :func:`cross_compile_portable`): nothing is compiled under emulation.

The root is cached at ``$P2PSWARM_ARM64_ROOT`` (default ``~/.cache/p2pswarm-arm64/root``) with a
stamp naming what went in; a changed wheel list rebuilds it. The project itself is *not* installed
in the root: :func:`stage_project` copies the working tree's ``p2pswarm`` package in for each run, so
the code tested is the code of the checkout.

Needs root (chroot, binfmt), ``qemu-user-static``, ``debootstrap`` and ``gcc-aarch64-linux-gnu``
(Debian packages; :func:`missing_tools` names the ones absent).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_ROOT = "P2PSWARM_ARM64_ROOT"
DEFAULT_ROOT = Path.home() / ".cache" / "p2pswarm-arm64" / "root"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
SITE = "usr/local/lib/python3.11/dist-packages"  # bookworm's python3 is 3.11, as here
STAMP_VERSION = 1
APT_PACKAGES = ("qemu-user-static", "debootstrap", "gcc-aarch64-linux-gnu")
TOOLS = {"qemu-aarch64-static": "qemu-user-static", "debootstrap": "debootstrap",
         "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu"}

# What a worker imports (the project's deps and theirs), at the versions installed on this host.
# Every one has a manylinux aarch64 (or pure-Python) wheel on PyPI at that version except those in
# WHEEL_OVERRIDES.
WHEELS = (
    "numpy", "gguf", "PyYAML", "tqdm", "msgpack", "trio", "attrs", "sortedcontainers", "idna", "outcome",
    "sniffio", "cryptography", "cffi", "pycparser", "libp2p", "aioquic", "certifi", "pylsqpack",
    "pyOpenSSL", "typing_extensions", "service-identity", "pyasn1", "pyasn1-modules", "anyio", "base58",
    "cbor2", "coincurve", "fastecdsa", "grpcio", "httpx", "httpcore", "h11", "lru-dict", "miniupnpc",
    "requests", "charset-normalizer", "urllib3", "multiaddr", "dnspython", "netaddr", "psutil", "py-cid",
    "py-multibase", "python-baseconv", "six", "morphys", "py-multicodec", "varint", "py-multihash",
    "blake3", "mmh3", "trio-typing", "mypy_extensions", "async-generator", "packaging",
    "importlib_metadata", "zipp", "lazy-importer", "mypy-protobuf", "protobuf", "types-protobuf",
    "types-requests", "noiseprotocol", "pycryptodome", "PyNaCl", "rpcudp", "u-msgpack-python",
    "prometheus_client", "trio-websocket", "wsproto", "zeroconf", "ifaddr",
    "tokenizers", "huggingface_hub", "click", "filelock", "fsspec", "hf-xet", "httpx2", "httpcore2", "truststore",
    "hypercorn", "h2", "hyperframe", "hpack", "priority", "typer", "shellingham", "rich", "markdown-it-py", "mdurl",
    "pygments", "annotated-doc", "typing-inspection", "zstandard",
)


# fastecdsa 2.3.2 (libp2p 0.8.1 pins it; imported by libp2p.crypto.ecc for secio) has no aarch64
# wheel on PyPI, and building it needs libgmp headers and a compiler inside the root (under
# emulation). 4.0.0 has a manylinux aarch64 wheel and the API libp2p imports (curve, keys, point,
# encoding.sec1, encoding.util.int_bytelen); our transports (noise) never call it.
WHEEL_OVERRIDES = {"fastecdsa": "4.0.0"}
# Pure-Python packages PyPI has only as sdists: built into wheels here (no compiler involved).
SDIST_ONLY = ("python-baseconv", "varint")


class TestBedError(RuntimeError):
    """The aarch64 root cannot be made here; the message says what is missing."""


def root_path() -> Path:
    return Path(os.environ.get(ENV_ROOT) or DEFAULT_ROOT)


def missing_tools() -> list[str]:
    """Debian packages that must be installed first (empty when all are there)."""
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})


def pinned_wheels() -> list[str]:
    out = []
    for name in WHEELS:
        try:
            out.append(f"{name}=={WHEEL_OVERRIDES.get(name) or importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dep not installed here: not needed there either
    return out


def _stamp(wheels: list[str]) -> str:
    return hashlib.sha256(f"{STAMP_VERSION}\n{SUITE}\n".encode() + "\n".join(wheels).encode()).hexdigest()[:16]


def register_binfmt() -> None:
    """Let the kernel run aarch64 ELF files through qemu-aarch64-static (idempotent)."""
    if (BINFMT / "qemu-aarch64").exists():
        return
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True,
                       capture_output=True)
    if not BINFMT_CONF.exists():
        raise TestBedError(f"{BINFMT_CONF} is missing (apt-get install qemu-user-static)")
    (BINFMT / "register").write_text(BINFMT_CONF.read_text().strip() + "\n")


def ensure_root(log=print) -> Path:
    """The cached arm64 root, built first if absent or stale. Raises :class:`TestBedError`."""
    if os.geteuid() != 0:
        raise TestBedError("the aarch64 test bed needs root (chroot, binfmt_misc)")
    missing = missing_tools()
    if missing:
        raise TestBedError(f"missing Debian packages: apt-get install {' '.join(missing)}")
    register_binfmt()
    root = root_path()
    wheels = pinned_wheels()
    stamp = _stamp(wheels)
    stamp_file = root / ".p2pswarm-stamp"
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return root
    t0 = time.monotonic()
    tmp = root.with_name(root.name + ".building")
    boot_ok = tmp / ".debootstrap-ok"  # a finished debootstrap is kept if a later step failed
    if not boot_ok.exists() and (root / ".debootstrap-ok").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        root.rename(tmp)  # only the wheels changed: keep the Debian part (and the cross-built libggml)
    if not boot_ok.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        log(f"arm64 root: debootstrap {SUITE} into {tmp} ...")
        r = subprocess.run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3", SUITE,
                            str(tmp), MIRROR], capture_output=True, text=True)
        if r.returncode != 0:
            raise TestBedError(f"debootstrap failed ({r.returncode}): {(r.stdout + r.stderr)[-600:]}")
        boot_ok.write_text("ok\n")
        log(f"arm64 root: debootstrap took {time.monotonic() - t0:.0f} s")
    log(f"arm64 root: installing {len(wheels)} aarch64 wheels ...")
    site = tmp / SITE
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
           "--abi", "none", "--target", str(site), "--disable-pip-version-check", "--no-compile"]
    for plat in ("manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_34_aarch64",
                 "manylinux_2_17_aarch64", "any"):
        cmd += ["--platform", plat]
    binary = [w for w in wheels if w.split("==")[0] not in SDIST_ONLY]
    sdists = [w for w in wheels if w.split("==")[0] in SDIST_ONLY]
    built = tmp.parent / "sdist-wheels"
    if sdists:
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                            "-w", str(built), *sdists], capture_output=True, text=True)
        if r.returncode != 0:
            raise TestBedError(f"pip could not build {sdists}: {r.stderr[-800:]}")
        binary += [str(p) for p in built.glob("*.whl")]
    r = subprocess.run(cmd + binary, capture_output=True, text=True)
    if r.returncode != 0:
        why = [ln for ln in (r.stdout + r.stderr).splitlines() if not ln.startswith("WARNING: Location")]
        raise TestBedError("pip could not get aarch64 wheels: " + " / ".join(why)[-1500:])
    stamp_file_tmp = tmp / ".p2pswarm-stamp"
    stamp_file_tmp.write_text(stamp + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    log(f"arm64 root: ready in {time.monotonic() - t0:.0f} s at {root}")
    return root


def cross_compile_portable(out: Path) -> Path:
    """Cross-compile p2pswarm/engine/experts/portable_kernel.c for aarch64 into ``out`` (a .so path)."""
    from p2pswarm.engine.experts import portable_kernel as pk

    cmd = ["aarch64-linux-gnu-gcc", *pk.CFLAGS, "-march=armv8-a", str(pk.C_SOURCE), "-o", str(out), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise TestBedError(f"cross-compiling the portable kernel failed: {r.stderr[-800:]}")
    return out


def ensure_libggml(root: Path, log=print) -> Path:
    """llama.cpp's libggml-base/libggml-cpu for aarch64, cross-compiled (never under emulation) from
    the ggml inside the llama-cpp-python sdist of the version installed here; cached in the root at
    ``/opt/libggml-aarch64`` (the path inside the root is returned). ~1 CPU-minute, a few minutes
    of wall time on a busy machine. Built for ``armv8.2-a+dotprod`` (every current phone core)."""
    inside = Path("/opt/libggml-aarch64")
    dest = root / inside.relative_to("/")
    version = importlib.metadata.version("llama_cpp_python")
    stamp = dest / ".version"
    if stamp.exists() and stamp.read_text().strip() == version:
        return inside
    for tool, pkg in (("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu"), ("cmake", "cmake"), ("ninja", "ninja-build")):
        if shutil.which(tool) is None:
            raise TestBedError(f"cross-compiling libggml needs {tool}: apt-get install {pkg}")
    t0 = time.monotonic()
    work = root.parent / "ggml-src"
    work.mkdir(parents=True, exist_ok=True)
    sdist = work / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", str(work)],
                           capture_output=True, text=True)
        if r.returncode != 0 or not sdist.exists():
            raise TestBedError(f"pip could not download the llama-cpp-python {version} sdist: {r.stderr[-500:]}")
    src = work / f"llama_cpp_python-{version}"
    if not src.exists():
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(work)], check=True)
    ggml = src / "vendor" / "llama.cpp" / "ggml"
    (ggml / "ggml.pc.in").touch()  # the sdist leaves out this pkg-config template; cmake wants the file
    build = work / "build-aarch64"
    log(f"arm64 root: cross-compiling libggml {version} for aarch64 ...")
    r = subprocess.run(["cmake", "-S", str(ggml), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
                        "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc", "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
                        "-DGGML_NATIVE=OFF", "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod", "-DGGML_OPENMP=OFF",
                        "-DGGML_BACKEND_DL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BUILD_TESTS=OFF",
                        "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_CCACHE=OFF"], capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run(["ninja", "-C", str(build), "-j2", "ggml-base", "ggml-cpu"], capture_output=True, text=True)
    if r.returncode != 0:
        raise TestBedError(f"cross-compiling libggml failed: {(r.stdout + r.stderr)[-800:]}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("libggml-base.so", "libggml-cpu.so"):
        shutil.copy2((build / "src" / name).resolve(), dest / name)
    stamp.write_text(version + "\n")
    log(f"arm64 root: libggml for aarch64 in {time.monotonic() - t0:.0f} s")
    return inside


def stage_project(root: Path, name: str) -> Path:
    """Copy this checkout's p2pswarm package (and an aarch64 build of its C kernel) into the root.

    Returns the directory *inside the root's view* (``/opt/<name>``) to put on PYTHONPATH; the host
    path is ``root / 'opt' / name``. Remove it with :func:`unstage`.
    """
    dest = root / "opt" / name
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(REPO / "p2pswarm", dest / "p2pswarm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    cross_compile_portable(dest / "libp2pswarm_portable.so")
    return Path("/opt") / name


def unstage(root: Path, name: str) -> None:
    shutil.rmtree(root / "opt" / name, ignore_errors=True)


def run_in_root(root: Path, argv: list[str], *, pythonpath: Path, env: dict | None = None, **kw):
    """subprocess.run(argv) inside the root (chroot, aarch64 under qemu). ``argv[0]`` is a root path."""
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                "PYTHONPATH": str(pythonpath), "P2PSWARM_PORTABLE_LIB": str(pythonpath / "libp2pswarm_portable.so"),
                "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.run([_chroot(), str(root), *argv], env=full_env, **kw)


def popen_in_root(root: Path, argv: list[str], *, pythonpath: Path, env: dict | None = None, **kw):
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                "PYTHONPATH": str(pythonpath), "P2PSWARM_PORTABLE_LIB": str(pythonpath / "libp2pswarm_portable.so"),
                "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    return subprocess.Popen([_chroot(), str(root), *argv], env=full_env, **kw)


class RootProcess:
    """``python3 -m p2pswarm.cli ARGS`` inside the root, started and waited for its ``READY <where>``
    line (python + libp2p imports take ~1 min under qemu on a busy machine, hence the long wait)."""

    def __init__(self, root: Path, pythonpath: Path, args: list[str], *, env: dict | None = None,
                 log: Path | None = None, timeout_s: float = 400.0):
        import threading

        self.log = log
        self.proc = popen_in_root(root, ["/usr/bin/python3", "-m", "p2pswarm.cli", *args], pythonpath=pythonpath,
                                  env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                  stderr=open(log, "w") if log else subprocess.DEVNULL)
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not line or not line[0].startswith("READY "):
            self.stop()
            tail = log.read_text()[-2000:] if log else ""
            raise TestBedError(f"aarch64 {' '.join(args[:3])} did not start: {tail}")
        self.where = line[0].split()[1]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a clean shutdown: records withdrawn), SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _chroot() -> str:
    return shutil.which("chroot") or "/usr/sbin/chroot"  # found on the host's PATH, not the root's


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="also import numpy and p2pswarm inside the root")
    args = ap.parse_args(argv)
    try:
        root = ensure_root()
        ggml = ensure_libggml(root)
        print(root)
        if args.check:
            pp = stage_project(root, "check")
            t0 = time.monotonic()
            r = run_in_root(root, ["/usr/bin/python3", "-c",
                                   "import platform, numpy, libp2p, trio, gguf, p2pswarm.cli; "
                                   "from p2pswarm.engine.experts import portable_kernel as pk; "
                                   "from p2pswarm.engine.ggml.lib import load_libggml; "
                                   "print(platform.machine(), numpy.__version__, pk.load_native().path, "
                                   "load_libggml().kernel_id)"],
                            pythonpath=pp, env={"P2PSWARM_GGML_LIB": str(ggml)}, capture_output=True, text=True)
            unstage(root, "check")
            print((r.stdout + r.stderr).strip(), f"({time.monotonic() - t0:.1f} s)")
            return r.returncode
    except TestBedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
