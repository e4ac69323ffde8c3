"""The system programs some tests need, and the one place that installs them.

``python tests/system_tools.py`` is part of the README's test command: it installs, with Debian's
``apt-get``, only the packages whose programs are missing (as root, or through a password-less
``sudo``). Where it cannot install (no apt, no root), it prints once exactly what to install and
exits 0, so the rest of the suite still runs; the tests that need a missing program then *fail*
with the same line (``require``), never skip: a skip on a fresh machine would hide a feature.

Why a script and not ``.ci/run`` alone: CI used to install these itself, so CI passed while a
new user's run of the README's command failed. Now both run the same command.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

# program -> (Debian package, what needs it)
TOOLS: dict[str, tuple[str, str]] = {
    "ip": ("iproute2", "the NAT test (tests/test_nat.py)"),
    "nft": ("nftables", "the NAT test (tests/test_nat.py)"),
    "chromium": ("chromium", "the status page in a headless browser (tests/test_openai_api.py)"),
    "chromedriver": ("chromium-driver", "the status page in a headless browser (tests/test_openai_api.py)"),
    "node": ("nodejs", "the js-libp2p interop test (tests/test_js_interop.py)"),
    "npm": ("npm", "the js-libp2p interop test (tests/test_js_interop.py)"),
    "qemu-aarch64-static": ("qemu-user-static", "the aarch64 worker (tests/test_arm64_worker.py)"),
    "debootstrap": ("debootstrap", "the aarch64 worker (tests/test_arm64_worker.py)"),
    "aarch64-linux-gnu-gcc": ("gcc-aarch64-linux-gnu", "the aarch64 worker (tests/test_arm64_worker.py)"),
    "aarch64-linux-gnu-g++": ("g++-aarch64-linux-gnu", "the aarch64 worker (tests/test_arm64_worker.py)"),
    "cmake": ("cmake", "the aarch64 worker's libggml (tests/test_arm64_worker.py)"),
    "ninja": ("ninja-build", "the aarch64 worker's libggml (tests/test_arm64_worker.py)"),
    "systemd-analyze": ("systemd", "the unit file check (tests/test_deploy_files.py)"),
}
SCRIPT = "python tests/system_tools.py"


def missing(*programs: str) -> list[str]:
    """The Debian packages (in TOOLS order, no repeats) whose program is not on PATH."""
    wanted = programs or tuple(TOOLS)
    out: list[str] = []
    for prog in wanted:
        pkg = TOOLS[prog][0]
        if shutil.which(prog) is None and pkg not in out:
            out.append(pkg)
    return out


def install_line(packages: list[str]) -> str:
    return f"apt-get install -y {' '.join(packages)}"


def require(*programs: str) -> None:
    """Fail the calling test (not skip) with the one line that says what to install."""
    import pytest

    pkgs = missing(*programs)
    if pkgs:
        progs = ", ".join(p for p in programs if shutil.which(p) is None)
        pytest.fail(f"not installed: {progs}; as root: {install_line(pkgs)} ({SCRIPT} does it)", pytrace=False)


def _privilege() -> list[str] | None:
    """How to run apt-get as root: [] when we are root, ["sudo", "-n"] with password-less sudo."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def main() -> int:
    pkgs = missing()
    if not pkgs:
        print("system_tools: every program the tests need is installed")
        return 0
    priv = _privilege()
    if priv is None or shutil.which("apt-get") is None:
        why = "not root and no password-less sudo" if shutil.which("apt-get") else "no apt-get on this machine"
        print(f"system_tools: cannot install ({why}); the tests that need them will fail until you run, "
              f"as root: {install_line(pkgs)}", file=sys.stderr)
        return 0
    print(f"system_tools: installing {' '.join(pkgs)} (apt-get; a few minutes the first time)", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *pkgs]):
        proc = subprocess.run([*priv, *cmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no message"]
            print(f"system_tools: `{' '.join(cmd)}` failed ({tail[0]}); the tests that need "
                  f"{' '.join(pkgs)} will fail until they are installed", file=sys.stderr)
            return 0
    still = missing()
    if still:
        print(f"system_tools: still missing after apt-get: {' '.join(still)}", file=sys.stderr)
    else:
        print("system_tools: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
