"""Build llama.cpp's libggml-base + libggml-cpu into ``p2pswarm/_native/`` (run by ``pip install``).

Why: the ggml kernel (``p2pswarm/engine/ggml/lib.py``) needs libggml, and no binary wheel of
llama-cpp-python or of ggml exists in the registries a user can reach. Without it every node runs
the numpy kernel (~7x the memory on Q4_K shards). So the install builds just the two libraries the
kernel uses, nothing of llama.cpp itself, in about a minute on 2 cores.

Source: the ggml that llama-cpp-python 0.3.36 vendors (ggml 0.25.3, llama.cpp commit 0c1e570), taken
from that exact sdist on PyPI (``pip download``, sha256 pinned below), because the test-suite
compares our kernel with that llama.cpp and the numbers must be the same. Only
``vendor/llama.cpp/ggml/`` is extracted. Set ``P2PSWARM_GGML_SOURCE`` to the sdist tarball to build
offline.

Build: ``native/CMakeLists.txt`` (ggml as a subdirectory, as llama.cpp adds it), Release (-O3),
``GGML_NATIVE=ON`` (llama-cpp-python's default), no BLAS, no tests/examples, on all cores. The
libraries are renamed ``libp2pswarm-ggml-{base,cpu}.so`` so they can never be mistaken, by name or
soname, for llama-cpp-python's own copies in the same process.

The result is cached under ``~/.cache/p2pswarm/libggml/<key>`` (key: source hash, build recipe,
compiler, CPU flags), so a reinstall on the same machine (e.g. ``pip install -e '.[test]'`` after
``pip install -e .``) copies it instead of compiling again.

Environment: ``P2PSWARM_GGML_BUILD=off`` installs without building (the numpy kernel, with a warning
at run time); ``CC``/``CXX`` pick the compiler; ``P2PSWARM_GGML_CACHE`` moves the cache.

Run it directly from a checkout (``python native/build_ggml.py``) to build into that checkout's
``p2pswarm/_native/`` without installing anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT_DIR = ROOT / "p2pswarm" / "_native"

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_MB = 77
SDIST_TOP = f"llama_cpp_python-{SDIST_VERSION}"
GGML_PREFIX = f"{SDIST_TOP}/vendor/llama.cpp/ggml/"
# The llama.cpp submodule HEAD recorded in the sdist's .git; ggml reports it as ggml_commit().
SUBMODULE_HEAD = f"{SDIST_TOP}/.git/modules/vendor/llama.cpp/HEAD"

LIBS = ("libp2pswarm-ggml-base", "libp2pswarm-ggml-cpu")
CMAKE_MIN = (3, 21)
CMAKE_PIN = "cmake==4.4.4"
NINJA_PIN = "ninja==1.13.2"
ENV_BUILD = "P2PSWARM_GGML_BUILD"
ENV_SOURCE = "P2PSWARM_GGML_SOURCE"
ENV_CACHE = "P2PSWARM_GGML_CACHE"
FAILED_LOG = "build-failed.log"  # kept in the cache folder after a failure, never after a success
# The options that matter for the bits ggml computes: the same as llama-cpp-python's default build
# (llama.cpp's CMakeLists turns llamafile's sgemm on for the ggml it adds; ggml alone defaults it off).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_LLAMAFILE=ON",
    "-DGGML_BLAS=OFF",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
    "-DGGML_CCACHE=OFF",
)


class BuildError(Exception):
    """A build step failed; the message is one line a user can act on."""


# ---- messages -------------------------------------------------------------------------------------
def _open_console():
    """pip captures a build backend's output and shows only a spinner (the output appears with -v or
    on failure), so a minute of compiling looked like a hang. Progress goes to the terminal itself
    when there is one; without one (a CI log, a redirected install), to pip's own stderr, which is
    the user's log (Linux: /proc/<pip>/fd/2, pip being this hook process's parent). Returns (stream,
    whether it is a terminal) or None."""
    try:
        return open("/dev/tty", "w", buffering=1), True  # kept for the whole build
    except OSError:
        pass
    try:
        # "a": a log file gets our lines at its end (a new open of a regular file starts at offset 0)
        return open(f"/proc/{os.getppid()}/fd/2", "a", buffering=1), False
    except OSError:
        return None


_console = None


def say(msg: str) -> None:
    global _console
    line = f"p2pswarm: {msg}"
    if _console is None:
        _console = _open_console() or False
    if _console:
        stream, tty = _console
        try:
            stream.write(("\r\033[K" if tty else "") + line + "\n")
            stream.flush()
        except OSError:
            pass
    print(line, file=sys.stderr, flush=True)


# ---- what the build needs -------------------------------------------------------------------------
def _cmake_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def build_requires() -> list[str]:
    """Extra build requirements: cmake/ninja from PyPI only where the machine lacks them (as
    scikit-build-core does), so a machine with a system cmake does not download 30 MB for nothing."""
    if disabled():
        return []
    req = []
    cmake = shutil.which("cmake")
    if cmake is None or (_cmake_version(cmake) or (0,)) < CMAKE_MIN:
        req.append(CMAKE_PIN)
    if shutil.which("ninja") is None:
        req.append(NINJA_PIN)
    return req


def disabled() -> bool:
    return os.environ.get(ENV_BUILD, "").strip().lower() in ("0", "off", "no", "false")


def _compilers() -> tuple[str, str]:
    cc = os.environ.get("CC") or "cc"
    cxx = os.environ.get("CXX") or "c++"
    missing = [name for name in (cc, cxx) if shutil.which(name.split()[0]) is None]
    if missing:
        raise BuildError(
            f"building libggml (the ggml kernel) needs a C and a C++ compiler, and {' and '.join(missing)} "
            "cannot be found: install one (Debian/Ubuntu: apt-get install build-essential; Fedora: dnf "
            "install gcc-c++; macOS: xcode-select --install) and run pip again, or set "
            f"{ENV_BUILD}=off to install without it (the numpy kernel, ~7x the memory)")
    return cc, cxx


def _compiler_id(cc: str, cxx: str) -> str:
    ids = []
    for exe in (cc, cxx):
        try:
            ids.append(subprocess.run([*exe.split(), "--version"], capture_output=True, text=True,
                                      timeout=30).stdout.splitlines()[0])
        except (OSError, subprocess.SubprocessError, IndexError):
            ids.append(exe)
    return " | ".join(ids)


def _cpu_flags() -> str:
    """-march=native compiles for this CPU: its flags are part of what was built."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# ---- the source -----------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _pip() -> list[str]:
    """A pip to run: this interpreter's, or (inside pip's isolated build environment, which hides
    the installed pip) the same interpreter in isolated mode, which sees its own site-packages."""
    for cmd in ([sys.executable, "-m", "pip"], [sys.executable, "-I", "-m", "pip"]):
        try:
            if subprocess.run([*cmd, "--version"], capture_output=True, timeout=60).returncode == 0:
                return cmd
        except (OSError, subprocess.SubprocessError):
            continue
    raise BuildError(f"pip is needed to fetch ggml's source ({SDIST_NAME} {SDIST_VERSION} sdist) and "
                     f"cannot be run with {sys.executable}; set {ENV_SOURCE} to a downloaded copy of it")


def _clean_env() -> dict:
    """This process runs inside pip's build-backend hook, whose variables (``_PYPROJECT_HOOKS_*``: our
    backend's name and backend-path; pip's build tracker) would be inherited by the nested pip and
    confuse its own hook for llama-cpp-python's backend ("Backend was not loaded from backend-path")."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("_PYPROJECT_HOOKS_", "PEP517_")) and k not in ("PIP_BUILD_TRACKER", "PIP_REQ_TRACKER")}


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the sdist. ``--no-binary`` names only llama-cpp-python: pip prepares the sdist's
    metadata with its build backend (scikit-build-core), which must come as a wheel (``:all:`` would
    build scikit-build-core and hatchling from source too)."""
    say(f"fetching ggml's source: the {SDIST_NAME} {SDIST_VERSION} sdist ({SDIST_MB} MB) from the package index")
    req = dest / "requirements.txt"
    req.write_text(f"{SDIST_NAME}=={SDIST_VERSION} --hash=sha256:{SDIST_SHA256}\n")
    cmd = [*_pip(), "download", "--no-deps", "--no-binary", SDIST_NAME, "--require-hashes",
           "--disable-pip-version-check", "-r", str(req), "-d", str(dest)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if proc.returncode != 0:
        kept = _keep_failed_log("$ " + " ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR:") or ln.lower().startswith("error:")]
        raise BuildError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} (ggml's source) failed: "
                         f"{(errors or lines or [proc.returncode])[-1]}; full output: {kept}; set "
                         f"{ENV_SOURCE} to the sdist to build offline")
    tarballs = sorted(dest.glob("*.tar.gz"))
    if not tarballs:
        raise BuildError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} produced no sdist")
    say(f"fetched in {time.monotonic() - t0:.0f} s")
    return tarballs[0]


def _source_tarball(work: Path) -> Path:
    env = os.environ.get(ENV_SOURCE)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise BuildError(f"{ENV_SOURCE}={env} is not a file (expected {SDIST_TOP}.tar.gz)")
    else:
        path = _download_sdist(work)
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise BuildError(f"{path} has sha256 {digest}, not the pinned {SDIST_NAME} {SDIST_VERSION} sdist's "
                         f"{SDIST_SHA256}")
    return path


def _extract_ggml(tarball: Path, dest: Path) -> tuple[Path, str]:
    """Only ``vendor/llama.cpp/ggml/`` (25 MB of 77), and the llama.cpp commit it comes from."""
    commit = None
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members = []
            for m in tar:
                if m.name == SUBMODULE_HEAD and m.isfile():
                    commit = tar.extractfile(m).read().decode().strip()[:7]
                elif m.name.startswith(GGML_PREFIX) and (m.isfile() or m.isdir()):
                    members.append(m)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BuildError(f"cannot unpack {tarball.name}: {exc}") from None
    src = dest / GGML_PREFIX
    if not (src / "CMakeLists.txt").is_file():
        raise BuildError(f"{tarball.name} has no {GGML_PREFIX}CMakeLists.txt")
    if not commit or not re.fullmatch(r"[0-9a-f]{7}", commit):
        raise BuildError(f"{tarball.name} does not record llama.cpp's commit ({SUBMODULE_HEAD})")
    return src, commit


# ---- the build ------------------------------------------------------------------------------------
def _cache_root() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "p2pswarm" / "libggml"


def _cache_key(cc: str, cxx: str) -> str:
    recipe = (HERE / "CMakeLists.txt").read_bytes()
    parts = [SDIST_SHA256, hashlib.sha256(recipe).hexdigest(), " ".join(CMAKE_OPTIONS),
             _compiler_id(cc, cxx), platform.machine(), platform.system(), _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _lib_name(stem: str) -> str:
    return stem + (".dylib" if sys.platform == "darwin" else ".so")


def _run_logged(cmd: list[str], log: Path, what: str, env: dict) -> None:
    """Run one build step, its output to ``log``; show ninja's [n/N] as a periodic progress line."""
    last_shown = 0.0
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            out.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]", line)
            now = time.monotonic()
            if m and (now - last_shown > 10 or m.group(1) == m.group(2)):
                last_shown = now
                say(f"{what}: {m.group(1)}/{m.group(2)} steps")
        rc = proc.wait()
    if rc != 0:
        text = log.read_text(errors="replace")
        tail = [ln.rstrip() for ln in text.splitlines() if ln.strip()][-15:]
        errors = [ln for ln in tail if "error" in ln.lower()]
        raise BuildError(f"{what} failed (exit {rc}): {(errors or tail or ['?'])[-1].strip()}; "
                         f"full log: {_keep_failed_log(text)}")


def _keep_failed_log(text: str) -> Path:
    """A failed build's log, kept where the build's cache lives (``~/.cache/p2pswarm/libggml/``),
    not at a fixed path in /tmp that another user's build would overwrite; a build that succeeds
    leaves none (its log lives in the build's own temporary folder, removed after)."""
    path = _cache_root() / FAILED_LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:  # a read-only home: the temporary folder's copy is all there is
        path = Path(tempfile.mkdtemp(prefix="p2pswarm-ggml-log-")) / FAILED_LOG
        path.write_text(text)
    return path


def _children_cpu_s() -> float:
    try:
        import resource  # POSIX only
    except ImportError:  # pragma: no cover - Windows
        return 0.0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _compile(src: Path, commit: str, work: Path, cc: str, cxx: str) -> Path:
    build = work / "build"
    log = work / "build.log"  # removed with ``work``; copied to the cache only if a step fails
    log.write_text("")
    (_cache_root() / FAILED_LOG).unlink(missing_ok=True)  # an earlier failure's log is stale now
    env = dict(os.environ, CC=cc, CXX=cxx)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake cannot be found (pip installs it from PyPI as a build requirement when "
                         "missing; running this script by hand: pip install " + CMAKE_PIN + ")")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = _jobs()
    say(f"building libggml-base + libggml-cpu (ggml from llama.cpp {commit}, -O3 -march=native) "
        f"on {jobs} core{'s' * (jobs > 1)}: about one CPU-minute")
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    _run_logged([cmake, "-S", str(HERE), "-B", str(build), *gen, f"-DGGML_SOURCE_DIR={src}",
                 f"-DP2PSWARM_GGML_COMMIT={commit}", *CMAKE_OPTIONS], log, "configuring libggml", env)
    _run_logged([cmake, "--build", str(build), "--target", "ggml-cpu", "--parallel", str(jobs)],
                log, "compiling libggml", env)
    say(f"libggml compiled in {time.monotonic() - t0:.0f} s ({_children_cpu_s() - cpu0:.0f} CPU-seconds)")
    return build / "lib"


def _install(lib_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stem in LIBS:
        name = _lib_name(stem)
        src = lib_dir / name
        if not src.is_file():
            raise BuildError(f"the build produced no {name} in {lib_dir}")
        tmp = out_dir / f".{name}.tmp"
        shutil.copy2(src, tmp)
        os.replace(tmp, out_dir / name)


def build(out_dir: Path = OUT_DIR) -> Path:
    """Make ``out_dir`` hold libp2pswarm-ggml-{base,cpu}: from the cache, or fetched and compiled."""
    cc, cxx = _compilers()
    key = _cache_key(cc, cxx)
    cached = _cache_root() / key
    if all((cached / _lib_name(s)).is_file() for s in LIBS):
        _install(cached, out_dir)
        say(f"libggml: reused the build cached in {cached}")
        return out_dir
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="p2pswarm-ggml-"))
    try:
        src, commit = _extract_ggml(_source_tarball(work), work / "src")
        lib_dir = _compile(src, commit, work, cc, cxx)
        _install(lib_dir, out_dir)
        try:
            _install(lib_dir, cached)
            (cached / "BUILD.json").write_text(json.dumps(
                {"sdist": f"{SDIST_NAME}=={SDIST_VERSION}", "sha256": SDIST_SHA256, "commit": commit,
                 "options": list(CMAKE_OPTIONS), "compiler": _compiler_id(cc, cxx)}, indent=1) + "\n")
        except OSError as exc:  # a read-only home is no reason to fail the install
            say(f"could not cache the build in {cached}: {exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"libggml ready in {out_dir} ({time.monotonic() - t0:.0f} s in all)")
    return out_dir


def build_for_install() -> None:
    """What the build backend calls before packaging: build, or stop pip with one clear line."""
    if disabled():
        say(f"{ENV_BUILD}=off: not building libggml; nodes will use the numpy kernel")
        return
    try:
        build()
    except BuildError as exc:
        say(f"error: {exc}")
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Build libggml-base + libggml-cpu into p2pswarm/_native/ "
                                             "(what pip install does), for a checkout used with PYTHONPATH.")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help=f"where the libraries go (default {OUT_DIR})")
    args = ap.parse_args(argv)
    try:
        build(args.out)
    except BuildError as exc:
        print(f"p2pswarm: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
