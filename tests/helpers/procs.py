"""Running `p2pswarm ...` processes in tests: start, wait for READY, read logs, stop."""
from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from p2pswarm.net.signed.identity import Identity, load_or_create_identity


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now (all bound at once, then released): for processes started
    next that must know each other's ports. A process that binds port 0 meanwhile may still take
    one of them; fewer such binds between choosing and using them, fewer collisions."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Proc:
    """A `p2pswarm ...` process; ``expect_ready`` waits for its ``READY <addr>`` line.

    ``prefix`` goes before the interpreter (qemu-user); ``entry`` replaces ``-m p2pswarm.cli`` (a
    test wrapper such as ``helpers/faulty_serve_shards.py``)."""

    def __init__(self, args: list[str], log: Path, env: dict, *, prefix: list[str] = (), expect_ready=True,
                 timeout: float = 90, entry: list[str] = ("-m", "p2pswarm.cli")):
        self.log = log
        with open(log, "w") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([*prefix, sys.executable, *entry, *args], stdout=subprocess.PIPE,
                                         stderr=err, stdin=subprocess.DEVNULL, text=True, env=env)
        self.addr = self.health = None
        if not expect_ready:
            return
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not line or not line[0].startswith("READY "):
            self.stop()
            raise AssertionError(f"{args[:3]} did not start: {log.read_text()[-3000:]}")
        parts = line[0].split()
        self.ready = parts[1:]  # the words after READY: the address, then key=value extras
        self.addr = parts[1] if len(parts) > 1 else None
        for p in parts[2:]:
            if p.startswith("health="):
                self.health = p.split("=", 1)[1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()

    def wait_log(self, needle: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if needle in self.text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not in log within {timeout} s: {self.text()[-3000:]}")

    def stop(self, sig=signal.SIGTERM) -> int:
        return stop_process(self.proc, sig)


def spawn_cli(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """A `p2pswarm ...` process started without waiting (:func:`read_first_lines` waits for a
    crowd of them at once); stderr to ``log``, stdout piped for its READY line."""
    return subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", *args], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), stdin=subprocess.DEVNULL, text=True, env=env)


def read_first_lines(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """The first stdout line of every process, read concurrently; "" for one that printed none
    within ``timeout`` (one deadline for all of them)."""
    lines: list[str | None] = [None] * len(procs)

    def read(i: int) -> None:
        lines[i] = procs[i].stdout.readline()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [x or "" for x in lines]


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, grace_s: float = 30) -> int:
    """``sig`` (SIGTERM: a clean shutdown), then SIGKILL if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_all(procs: list[subprocess.Popen], sig=signal.SIGTERM, grace_s: float = 30) -> None:
    """:func:`stop_process` for many at once: ``sig`` to every one still running first, so they
    shut down side by side, then wait for each (SIGKILL after ``grace_s``). SIGCONT before ``sig``:
    a stopped process (SIGSTOP, a test's hung worker) acts on it only once continued."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(sig)
    for p in procs:
        stop_process(p, sig, grace_s)


def wait_until(cond, timeout: float = 30, interval: float = 0.05, what: str = "condition"):
    """Poll ``cond()`` until it returns something truthy (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


def get_health(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def start_bootstrap(tmp_path, env, name: str = "boot") -> Proc:
    """A `p2pswarm bootstrap` node on 127.0.0.1 (the DHT entry point of a test swarm)."""
    return Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / f"{name}.key")],
                tmp_path / f"{name}.log", env)


def start_shard_workers(model, tmp_path, env, ranges, bootstrap: str, extra=()) -> list[Proc]:
    """One `p2pswarm node --role worker` per expert range (all layers), each with its own shard
    cut from ``model`` and its own key, found through ``bootstrap``. Stops the started ones if a
    later one fails."""
    from p2pswarm.model.slicer import slice_experts

    workers: list[Proc] = []
    try:
        for i, (e0, e1) in enumerate(ranges):
            shard = tmp_path / f"shard{i}.gguf"
            slice_experts(model, shard, None, (e0, e1))
            workers.append(Proc(["node", "--role", "worker", "--shard", str(shard), "--bootstrap", bootstrap,
                                 "--identity", str(tmp_path / f"w{i}.key"), *extra], tmp_path / f"w{i}.log", env))
    except BaseException:
        for w in reversed(workers):
            w.stop()
        raise
    return workers


def assert_swarm_logits_exact(model, tokens: str, swarm: str, tmp_path, env, *, decode: bool,
                              kernel: str = "numpy") -> dict:
    """`logits --swarm` equals the monolithic run bit for bit, and the workers computed it (no
    fallback, remote requests made). Returns the swarm run's --json stats."""
    import numpy as np

    flag = ["--decode"] if decode else []
    mono, out = tmp_path / f"mono{decode}.npy", tmp_path / f"swarm{decode}.npy"
    for path, where in ((mono, []), (out, ["--swarm", swarm])):
        proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "logits", str(model), "--tokens", tokens,
                               "--out", str(path), "--kernel", kernel, "--json", *where, *flag],
                              capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    assert stats["fallbacks"] == 0 and stats["requests"] > 0 and stats["remote_groups"] > 0, stats
    assert np.array_equal(np.load(mono), np.load(out))
    return stats


@contextlib.contextmanager
def shard_swarm(model, tmp_path, env, ranges, extra=()):
    """A bootstrap node and :func:`start_shard_workers`' workers found through it, as ``(boot,
    workers)``; every one stopped on exit, workers first."""
    boot, workers = None, []
    try:
        boot = start_bootstrap(tmp_path, env)
        workers = start_shard_workers(model, tmp_path, env, ranges, boot.addr, extra)
        yield boot, workers
    finally:
        for w in reversed(workers):
            w.stop()
        if boot is not None:
            boot.stop()


def assert_swarm_prefill_and_decode_exact(model, tokens: list[int], swarm: str, tmp_path, env,
                                          kernel: str = "numpy") -> None:
    """:func:`assert_swarm_logits_exact` for one prefill and for one-token decode steps."""
    for decode in (False, True):
        assert_swarm_logits_exact(model, ",".join(map(str, tokens)), swarm, tmp_path, env, decode=decode,
                                  kernel=kernel)


def start_relay(tmp_path, env, *, issuer=None, port=None, name="relay", host="127.0.0.1", extra=()) -> Proc:
    port = port or free_port(host)
    args = ["relay", "--listen", f"/ip4/{host}/tcp/{port}/ws", "--identity", str(tmp_path / f"{name}.key"),
            "--health", f"127.0.0.1:{free_port()}", *extra]
    args += ["--trust-issuer", issuer.peer_id_str] if issuer is not None else ["--open"]
    return Proc(args, tmp_path / f"{name}.log", env)


def worker_identity(tmp_path, name: str) -> Identity:
    return load_or_create_identity(tmp_path / f"{name}.key")


def worker_args(tmp_path, shard, relay_addr, name, token=None, extra=()) -> list[str]:
    args = ["node", "--role", "worker", "--shard", str(shard), "--relay", relay_addr,
            "--identity", str(tmp_path / f"{name}.key"), "--ttl", "120", *extra]
    return args + (["--token", token] if token else [])
