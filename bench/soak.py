"""Soak: a swarm of real processes under load and a seeded fault schedule, every answer checked.

    python bench/soak.py --duration-s 1800 --seed 1 [--model M.gguf] [--workdir DIR] [--json OUT]

Jepsen-style, on 127.0.0.1 and network namespaces of its own (``p2ps-soak-<pid><i>``; needs root,
``ip`` and ``nft``; a killed run's namespaces are removed by the next run):

* **the swarm**: two bootstraps, a relay (``--open``), two backbones with ``--http`` and
  ``--verify-rate`` (one holding the model and serving its bytes by a signed manifest, one holding
  only the dense part with ``--expert-cache 10%`` filled from the swarm), eight honest workers (two
  direct, three behind WAN-emulating proxies of different RTTs, one capped at 20 Mbit/s, two in
  network namespaces behind a NAT - nothing in, out only to the relay's WebSocket, masqueraded -
  reachable only through the relay, one in a namespace dialled directly), one ``--auto`` worker
  (picks its units from the backbones' demand, downloads them by manifest) and one dishonest
  worker (tests/helpers/dishonest_worker.py: a wrong element in 5% of its rows).
* **the load** (:class:`Load`): threads with the official ``openai`` client: chats streamed and
  not, greedy and seeded, some clients that hang up mid-stream.
* **the nemesis** (:class:`Nemesis`): one fault at a time from a seeded schedule: kill -9 and
  restart of a worker, SIGSTOP/SIGCONT, the relay killed and restarted, a bootstrap killed and
  restarted, a worker restarted on a corrupt (truncated) shard first, garbage on a worker's and the
  backbones' ports (raw TCP) and garbage frames on an expert stream (libp2p), a namespaced
  worker's link dropped for 20-60 s (nftables: a partition) or rate-limited to 20-200 kB/s.
* **the checker** (:func:`check`): every completed response equals the monolithic reference (the
  same request on a backbone computing alone: greedy, or the same seed) token for token; every
  request completes or ends with an error in OpenAI's shape; none hangs; the dishonest worker is
  banned; after each fault every honest worker is back in service within its bound (60 s, 90 s
  after a partition: soak_check.RECOVERY_BOUNDS_S); the
  backbones' and two never-faulted workers' resident memory, descriptors, trio tasks and DHT
  records sampled over time, with their slopes after warm-up.

tests/test_soak.py runs a 2.5-minute version with the same checker on a smaller swarm (``SHORT``: five
honest workers, no ``--auto`` worker). Results: docs/benchmarks.md ("Soak").
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from helpers.netns import Netns, cleanup_stale
from helpers.procs import Proc, free_ports, stop_all  # the tests' process helpers
from soak_check import LONG_LIVED, PROMPTS, RECOVERY_WAIT_S, Load, _now, check, summarise
from soak_probes import _echo, _garbage_frames, _http, monolithic_references, sample

HONEST = [  # (name, experts, how it is reached)
    ("w0", (0, 8), "direct"), ("w1", (8, 16), "direct"),  # never faulted: their slopes are sampled
    ("w2", (0, 8), "wan:20"), ("w3", (8, 16), "wan:60"), ("w4", (0, 16), "wan:120:20"),
    ("w5", (0, 8), "nat"), ("w6", (8, 16), "nat"),  # each in a network namespace behind a NAT: relay only
    ("w7", (0, 16), "netns"),  # in a namespace of its own, dialled directly: partitions and slow links
]
#: the short run's (tests/test_soak.py): one worker of each way in, 5 of the 8 processes fewer to start
SHORT = [h for h in HONEST if h[0] in ("w0", "w1", "w2", "w5", "w7")]


@dataclass
class Node:
    """A process the nemesis may kill and restart with the same arguments (same identity, same
    port, so the same address)."""

    name: str
    args: list[str]
    dir: Path
    env: dict
    entry: tuple = ("-m", "p2pswarm.cli")
    prefix: tuple = ()  # ``ip netns exec NS``: a node in a network namespace
    proc: Proc | None = None
    starts: int = 0

    def start(self, args: list[str] | None = None, expect_ready: bool = True) -> Proc:
        self.starts += 1
        self.proc = Proc(args or self.args, self.dir / f"{self.name}.{self.starts}.log", self.env,
                         entry=self.entry, expect_ready=expect_ready, prefix=list(self.prefix))
        return self.proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig) -> None:
        if self.proc.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.proc.kill()



class Swarm:
    """Start (``__enter__``) and stop every process: the honest workers of ``roster`` (HONEST, or
    SHORT), the ``--auto`` worker when ``auto``, and the rest of the swarm."""

    def __init__(self, model: Path, workdir: Path, *, verify_rate: float, seed: int,
                 roster: list = HONEST, auto: bool = True):
        self.model, self.dir = Path(model), Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_THREADS="1",
                        P2PSWARM_HOME=str(self.dir / "home"), P2PSWARM_CACHE=str(self.dir / "cache"))
        self.verify_rate, self.seed = verify_rate, seed
        self.roster, self.auto = list(roster), auto
        self.how = {n: how for n, _, how in self.roster}
        self.namespaced = tuple(n for n, _, how in self.roster if how in ("nat", "netns"))
        self.nodes: dict[str, Node] = {}
        self.shards: dict[str, Path] = {}
        self.peer_ids: dict[str, str] = {}
        self.waves_s: dict[str, float] = {}  # how long each wave of starts took (where a short run's time goes)

    def _node(self, name, args, entry=("-m", "p2pswarm.cli"), prefix=(), start=True) -> Node:
        n = Node(name, args, self.dir, self.env, entry=entry, prefix=tuple(prefix))
        self.nodes[name] = n
        if start:
            n.start()
        return n

    def _cli(self, *args: str) -> None:
        subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args], check=True, env=self.env,
                       stdout=subprocess.DEVNULL)

    def __enter__(self) -> Swarm:
        """Start the swarm in two waves of processes started together (most of a short run is
        start-up on 2 cores): the bootstraps and WAN proxies, then everything else, the NATed
        workers once the relay is up. Peer ids come from the identity files, made first."""
        from p2pswarm.model.layout import ModelLayout
        from p2pswarm.model.manifest import source_fingerprint
        from p2pswarm.model.slicer import slice_experts
        from p2pswarm.net.signed.identity import load_or_create_identity
        from p2pswarm.net.signed.tokens import issue_token

        try:
            ports = iter(free_ports(40))
            d = self.dir
            cleanup_stale()
            self.netns = {name: Netns(f"{os.getpid()}{i}", (os.getpid() * 7 + i) % 250).create()
                          for i, name in enumerate(self.namespaced)}
            part = [ns for name, ns in self.netns.items() if self.how[name] == "netns"]
            ids = {n: load_or_create_identity(d / f"{n}.key").peer_id_str
                   for n in ("boot1", "boot2", "relay", "backbone", "backbone2", "auto", "issuer")}
            boot_ports = {b: next(ports) for b in ("boot1", "boot2")}
            self.boots = boots = [f"/ip4/127.0.0.1/tcp/{boot_ports[b]}/p2p/{ids[b]}" for b in ("boot1", "boot2")]
            first: list[Node] = []
            for b in ("boot1", "boot2"):
                port = boot_ports[b]
                extra = [a for ns in part for a in ("--listen", f"/ip4/{ns.host_ip}/tcp/{port}")]
                first.append(self._node(b, ["bootstrap", "--listen", f"/ip4/127.0.0.1/tcp/{port}", *extra,
                                            "--identity", str(d / f"{b}.key")], start=False))
            wan = [(name, how) for name, _, how in self.roster if how.startswith("wan")]
            listen = {name: next(ports) for name, _, _ in self.roster}
            for name, how in wan:
                _, rtt, *mbps = how.split(":")
                link = next(ports)
                first.append(self._node(f"proxy-{name}", ["--target", f"127.0.0.1:{listen[name]}", "--listen",
                                                         f"127.0.0.1:{link}", "--rtt-ms", rtt,
                                                         *(["--mbps", mbps[0]] if mbps else [])],
                                        entry=("-m", "p2pswarm.net.wire.wanproxy"), start=False))
                listen[name] = (listen[name], link)
            # files: the shards, a signed manifest (the first backbone serves the model's bytes by
            # it, to the --auto worker and to the second backbone's expert cache, both trusting its
            # issuer), and the second backbone's dense part
            manifest, dense = d / "model.manifest", d / "backbone-dense.gguf"
            prep = [] if manifest.exists() else [["manifest", "--model", str(self.model), "--key",
                                                  str(d / "issuer.key"), "--out", str(manifest)]]
            prep += [] if dense.exists() else [["slice", str(self.model), "--backbone", "-o", str(dense)]]
            t0 = _now()
            with ThreadPoolExecutor(len(first) + len(prep)) as pool:
                done = [pool.submit(n.start) for n in first] + [pool.submit(self._cli, *a) for a in prep]
                for name, (e0, e1), _ in self.roster:
                    shard = self.shards[name] = d / f"shard-{e0}-{e1}.gguf"
                    if not shard.exists():
                        slice_experts(self.model, shard, None, (e0, e1))
                for f in done:
                    f.result()
            self.waves_s["bootstraps_proxies_files"] = round(_now() - t0, 1)
            # the relay also listens on each NAT namespace's side of its veth (WebSocket: all a NAT lets out)
            relay_ws = {name: (ns.host_ip, next(ports)) for name, ns in self.netns.items()}
            relay = self._node("relay", ["relay", "--listen", f"/ip4/127.0.0.1/tcp/{next(ports)}/ws",
                                         "--listen", f"/ip4/127.0.0.1/tcp/{next(ports)}", "--open",
                                         *[a for h, p in relay_ws.values()
                                           for a in ("--listen", f"/ip4/{h}/tcp/{p}/ws")],
                                         "--identity", str(d / "relay.key"), "--bootstrap", boots[0]], start=False)
            second: list[Node] = []
            for name, _, how in self.roster:
                args = ["node", "--role", "worker", "--shard", str(self.shards[name]),
                        "--identity", str(d / f"{name}.key"), "--ttl", "60"]
                prefix: list[str] = []
                if how == "nat":  # in its namespace, nothing in, out only to the relay's WebSocket, masqueraded
                    ns = self.netns[name]
                    host, port = relay_ws[name]
                    ns.nat([(host, port)])
                    prefix = ns.prefix
                    args += ["--relay", f"/ip4/{host}/tcp/{port}/ws/p2p/{ids['relay']}",
                             "--listen", f"/ip4/{ns.ns_ip}/tcp/{listen[name]}"]
                elif how == "netns":  # its own namespace, dialled at its address there; bootstraps via the veth
                    ns = self.netns[name]
                    prefix = ns.prefix
                    args += [a for bt in boots
                             for a in ("--bootstrap", bt.replace("/ip4/127.0.0.1/", f"/ip4/{ns.host_ip}/"))]
                    args += ["--listen", f"/ip4/{ns.ns_ip}/tcp/{listen[name]}"]
                elif how == "direct":
                    args += ["--bootstrap", boots[0], "--bootstrap", boots[1],
                             "--listen", f"/ip4/127.0.0.1/tcp/{listen[name]}"]
                else:
                    port, link = listen[name]
                    args += ["--bootstrap", boots[0], "--bootstrap", boots[1], "--listen",
                             f"/ip4/127.0.0.1/tcp/{port}", "--announce", f"/ip4/127.0.0.1/tcp/{link}"]
                if name in LONG_LIVED:  # sampled: trio tasks and DHT records from its /health
                    args += ["--health", f"127.0.0.1:{next(ports)}"]
                second.append(self._node(name, args, prefix=prefix, start=False))
            second.append(self._node("liar", [str(ROOT / "tests" / "helpers" / "dishonest_worker.py"), "--shard",
                                              str(self.shards["w0"]), "--bootstrap", boots[1], "--identity",
                                              str(d / "liar.key"), "--receipts-dir", str(d / "liar-receipts"),
                                              "--fraction", "0.05", "--seed", str(self.seed)], entry=(), start=False))
            fp = source_fingerprint(ModelLayout.open(self.model))
            common = ["--bootstrap", boots[0], "--bootstrap", boots[1], "--http", "127.0.0.1:0", "--timeout", "5",
                      "--verify-rate", str(self.verify_rate), "--verify-seed", str(self.seed), "--ban-refresh", "5",
                      "--served-model-name", "tiny"]
            second.append(self._node("backbone", ["node", "--role", "backbone", "--model", str(self.model), "--manifest",
                                                  str(manifest), "--identity", str(d / "backbone.key"), *common],
                                     start=False))
            # a second backbone that does not hold the model: the dense part, a cache of 10 % of the
            # experts filled from the swarm, the rest always from workers
            issuer = load_or_create_identity(d / "issuer.key")
            tok2 = d / "backbone2.token"
            tok2.write_text(issue_token(issuer, ids["backbone2"], [f"shard:{fp}"], 30 * 86400).encode())
            second.append(self._node("backbone2", ["node", "--role", "backbone", "--model", str(dense), "--expert-cache",
                                                   "10%", "--token", str(tok2), "--trust-issuer", issuer.peer_id_str,
                                                   "--trust-bans", ids["backbone"],
                                                   "--identity", str(d / "backbone2.key"), *common], start=False))
            if self.auto:  # an --auto worker: reads the backbones' demand, picks its units, downloads them by manifest
                tok = issue_token(issuer, ids["auto"], [f"shard:{fp}"], 30 * 86400).encode()
                second.append(self._node("auto", ["node", "--role", "worker", "--auto", "--memory", "64MB", "--token",
                                                  tok, "--trust-issuer", issuer.peer_id_str, "--bootstrap", boots[0],
                                                  "--bootstrap", boots[1], "--identity", str(d / "auto.key"),
                                                  "--ttl", "60"], start=False))
            nat = [n for n in second if self.how.get(n.name) == "nat"]
            backbones = [n for n in second if n.name.startswith("backbone") or n.name == "auto"]
            t0 = _now()
            with ThreadPoolExecutor(len(second) + 1) as pool:  # the NATed workers once the relay is up,
                done = [pool.submit(n.start) for n in [relay] + [n for n in second if n not in nat + backbones]]
                done[0].result()
                done += [pool.submit(n.start) for n in nat]
                for f in done:
                    f.result()
                self.waves_s["relay_workers"] = round(_now() - t0, 1)
                t0 = _now()
                # the backbones once every worker is in the DHT: their first coverage refresh finds
                # them all (one found later waits for the next refresh, 30 s); the --auto worker
                # with them (it is ready once it enrolled from their demand)
                for f in [pool.submit(n.start) for n in backbones]:
                    f.result()
                self.waves_s["backbones"] = round(_now() - t0, 1)
            self.relay_addr = relay.proc.addr
            for name, _, _ in self.roster:
                self.peer_ids[name] = self.nodes[name].proc.addr.rsplit("/p2p/", 1)[1]
            self.liar_id = self.nodes["liar"].proc.addr.rsplit("/p2p/", 1)[1]
            self.base = _http(self.nodes["backbone"].proc)
            self.bases = [self.base, _http(self.nodes["backbone2"].proc)]
            if self.auto:
                self.peer_ids["auto"] = self.nodes["auto"].proc.addr.rsplit("/p2p/", 1)[1]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """Stop the processes side by side (one by one took seconds each): the backbones and workers
        first, while the relay and bootstraps that carry their records' withdrawal still run."""
        for last in (False, True):  # stop_all continues a process the nemesis stopped
            stop_all([n.proc.proc for name, n in self.nodes.items() if n.proc is not None
                      and (name in ("boot1", "boot2", "relay") or name.startswith("proxy-")) == last])
        for ns in getattr(self, "netns", {}).values():
            ns.delete()

    def get(self, path: str) -> dict:
        import httpx

        return httpx.get(self.base + path, timeout=30).json()

    def served(self) -> dict[str, tuple[str, int]]:
        """Each honest worker's state in the backbone's view (live, back-off, ...) and the expert
        requests it answered (requests less failures)."""
        by_peer = {w["peer"]: w for w in self.get("/v1/swarm")["workers"]}
        out = {}
        for name, pid in self.peer_ids.items():
            w = by_peer.get(pid)
            out[name] = ("absent", -1) if w is None else (w["state"], w["requests"] - w["failures"])
        return out

    def nat_relayed(self) -> dict[str, dict[str, bool]]:
        """Per backbone, whether its connection to each NATed worker goes through the relay (it
        must: nothing can reach them directly; on loopback without a NAT a worker's own outbound
        connection made it look direct, which a real NAT would not allow)."""
        import httpx

        out = {}
        for name, base in zip(("backbone", "backbone2"), self.bases):
            ws = httpx.get(base + "/v1/swarm", timeout=30).json()["workers"]
            out[name] = {w: any(x["peer"] == self.peer_ids[w] and x["relayed"] for x in ws)
                         for w in self.namespaced if self.how[w] == "nat"}
        return out

    def wait_full(self, timeout_s: float, targets: tuple[str, ...] = ()) -> float | None:
        """Seconds until full worker service: every honest worker live in the backbone's view (none
        in back-off after a failure, none missing), no fallback to the backbone's own replica
        between two polls, and each of ``targets`` (the workers the fault hit) answering an expert
        echo at the address it announced (through its WAN proxy or the relay, as a backbone dials
        it). None: not within ``timeout_s``.

        Not "the backbone sent it requests again": it ranks replicas by round trip and load, so a
        slower replica may rightly get none while faster ones serve (measured: w4, 120 ms behind
        its proxy, got no request for minutes after its restart)."""
        t0 = _now()
        fallbacks = None
        answered: set[str] = set()
        while _now() - t0 < timeout_s:
            try:
                now = self.served()
                fb, fallbacks = fallbacks, self.get("/health")["fallbacks"]
                for t in set(targets) - answered:
                    if _echo(self.nodes[t].proc.addr):
                        answered.add(t)
                if fb == fallbacks and all(st == "live" for st, _ in now.values()) and answered == set(targets):
                    return _now() - t0
            except Exception:
                pass
            time.sleep(0.5)
        return None


class Nemesis:
    """Faults from a seeded schedule, one at a time, each undone and its recovery timed."""

    KINDS = ("kill9", "stop", "relay", "bootstrap", "corrupt_shard", "garbage", "partition", "slow")

    def __init__(self, swarm: Swarm, seed: int, every_s: float, hold_scale: float = 1.0):
        self.swarm, self.every_s, self.hold_scale = swarm, every_s, hold_scale
        self.rng = random.Random(seed)
        self.faults: list[dict] = []
        self.stop = threading.Event()
        self.fault_windows: list[tuple[float, float]] = []

    def _hold(self, lo: float, hi: float) -> float:
        """How long a fault is held (or a killed node stays down): uniform in [lo, hi] seconds
        times ``hold_scale`` (1 in the long run; the short test's is smaller)."""
        return self.rng.uniform(lo, hi) * self.hold_scale

    def schedule(self, n: int) -> list[str]:
        """The kinds, in order: every kind once per round, shuffled (a short run still sees each)."""
        kinds: list[str] = []
        while len(kinds) < n:
            round_ = list(self.KINDS)
            self.rng.shuffle(round_)
            kinds += round_
        return kinds[:n]

    def run(self) -> None:
        for kind in self.schedule(10_000):
            if self.stop.wait(self.every_s * self.rng.uniform(0.5, 1.0)):
                return
            victims = (self.swarm.namespaced if kind in ("partition", "slow")
                       else [n for n, _, _ in self.swarm.roster if n not in LONG_LIVED])
            victim = self.rng.choice(victims)
            t0 = _now()
            fault = {"kind": kind, "t": round(t0, 1)}
            try:
                fault.update(getattr(self, f"_{kind}")(victim))
            except Exception as exc:  # a fault that could not be injected is a finding, recorded
                fault["inject_error"] = f"{type(exc).__name__}: {exc}"
            undone = _now()
            fault["recovery_s"] = self.swarm.wait_full(RECOVERY_WAIT_S, fault.get("hit", ()))
            self.fault_windows.append((t0, _now()))
            self.faults.append(fault)
            print(f"[soak] fault {len(self.faults)}: {fault} (held {undone - t0:.1f} s)", flush=True)

    def _kill9(self, victim: str) -> dict:
        node = self.swarm.nodes[victim]
        node.kill()
        time.sleep(self._hold(2, 6))
        node.start()
        return {"target": victim, "hit": (victim,)}

    def _stop(self, victim: str) -> dict:
        node = self.swarm.nodes[victim]
        held = self._hold(5, 15)
        node.signal(signal.SIGSTOP)
        time.sleep(held)
        node.signal(signal.SIGCONT)
        return {"target": victim, "held_s": round(held, 1), "hit": (victim,)}

    def _relay(self, victim: str) -> dict:
        node = self.swarm.nodes["relay"]
        node.kill()
        time.sleep(self._hold(2, 5))
        node.start()
        return {"target": "relay", "hit": tuple(n for n, _, how in self.swarm.roster if how == "nat")}

    def _bootstrap(self, victim: str) -> dict:
        node = self.swarm.nodes["boot2"]
        node.kill()
        time.sleep(self._hold(5, 10))
        node.start()
        return {"target": "boot2"}

    def _corrupt_shard(self, victim: str) -> dict:
        """kill -9, restart on a truncated copy of its shard (it must refuse with one line, no
        traceback), then on the good shard."""
        node = self.swarm.nodes[victim]
        good = self.swarm.shards[victim]
        bad = self.swarm.dir / f"corrupt-{victim}.gguf"
        data = good.read_bytes()
        bad.write_bytes(data[: len(data) * 2 // 3])
        node.kill()
        args = list(node.args)
        args[args.index(str(good))] = str(bad)
        p = node.start(args, expect_ready=False)
        try:
            rc = p.proc.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = None
        text = p.text()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        node.start()
        bad.unlink()
        return {"target": victim, "hit": (victim,), "refused_rc": rc, "traceback": "Traceback" in text,
                "error_line": lines[-1][-200:] if lines else ""}

    def _partition(self, victim: str) -> dict:
        """Every packet of the victim's link dropped (nftables in its namespace) for 20-60 s: its
        connections stall rather than close, so the backbones must notice by timeout; then healed."""
        ns = self.swarm.netns[victim]
        held = self._hold(20, 60)
        ns.partition()
        try:
            time.sleep(held)
        finally:
            ns.heal()
        return {"target": victim, "held_s": round(held, 1), "hit": (victim,)}

    def _slow(self, victim: str) -> dict:
        """The victim's link rate-limited (nftables, both ways) to 20-200 kB/s, as long as a partition."""
        ns = self.swarm.netns[victim]
        held, rate = self._hold(20, 60), self.rng.choice((20, 50, 200))
        ns.slow(rate)
        try:
            time.sleep(held)
        finally:
            ns.heal()
        return {"target": victim, "held_s": round(held, 1), "kbytes_s": rate, "hit": (victim,)}

    def _garbage(self, victim: str) -> dict:
        """Random bytes on a worker's libp2p port and the backbone's HTTP port (raw TCP), and garbage
        frames on an expert stream (a real libp2p peer)."""
        rng = random.Random(self.rng.randrange(1 << 30))
        node = self.swarm.nodes[victim]
        listen = node.args[node.args.index("--listen") + 1].split("/") if "--listen" in node.args else None
        targets = [("127.0.0.1", int(b.rsplit(":", 1)[1])) for b in self.swarm.bases]
        if listen and self.swarm.how[victim] != "nat":  # a NATed worker's port cannot be reached: that is its point
            targets.insert(0, (listen[2], int(listen[4])))
        sent = 0
        for target in targets:
            for _ in range(5 if self.hold_scale >= 1 else 2):
                with socket.create_connection(target, timeout=5) as s:
                    blob = rng.randbytes(rng.randrange(1, 4096))
                    try:
                        s.sendall(blob)
                        s.settimeout(2 if self.hold_scale >= 1 else 0.5)
                        s.recv(1024)
                    except OSError:
                        pass
                    sent += len(blob)
        frames = _garbage_frames(self.swarm.nodes[victim].proc.addr, rng)
        return {"target": victim, "raw_bytes": sent, "frames": frames}


def make_tiny(workdir: Path) -> Path:
    model = workdir / "tiny-f32.gguf"
    if not model.exists():
        subprocess.run([sys.executable, "-m", "p2pswarm.cli", "make-model", "--preset", "tiny", "--type", "f32", "-q",
                        "--seed", "1", "-o", str(model)], check=True, stdout=subprocess.DEVNULL)
    return model


def run_soak(model: Path | None, workdir: Path, *, duration_s: float, seed: int, clients: int = 4,
             fault_every_s: float = 20.0, verify_rate: float = 0.25, sample_every_s: float = 5.0,
             warmup_s: float | None = None, min_faults: int = 0,
             hold_scale: float = 1.0, prompts: int = len(PROMPTS), roster: list = HONEST, auto: bool = True) -> dict:
    """Run the soak for ``duration_s`` (longer until ``min_faults`` faults were injected, at most
    four times as long or 120 s a fault) and return the checker's report (``report["problems"]``:
    empty if every promise was kept)."""
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(model) if model else make_tiny(workdir)
    swarm = Swarm(model, workdir / "swarm", verify_rate=verify_rate, seed=seed, roster=roster, auto=auto)
    t0 = _now()
    print("[soak] monolithic references ...", flush=True)
    refs = monolithic_references(model, workdir, swarm.env, prompts)
    setup = {"references_s": round(_now() - t0, 1)}
    print(f"[soak] {len(refs)} references in {setup['references_s']} s; starting the swarm", flush=True)
    with swarm:
        if swarm.wait_full(120) is None:
            raise RuntimeError(f"the swarm never reached full worker service: {swarm.get('/v1/swarm')['workers']}")
        setup["swarm_s"] = round(_now() - t0 - setup["references_s"], 1)
        print(f"[soak] full worker service {setup['swarm_s']} s after the first start", flush=True)
        load = Load(swarm.bases, clients, seed, prompts=prompts)
        nemesis = Nemesis(swarm, seed, fault_every_s, hold_scale)
        samples: list[dict] = []
        started = _now()
        threads = load.run()
        nem = threading.Thread(target=nemesis.run, daemon=True)
        nem.start()
        sampled = -sample_every_s
        while (_now() - started < duration_s or len(nemesis.faults) < min_faults) \
                and _now() - started < max(4 * duration_s, duration_s + 120 * min_faults):
            if _now() - sampled >= sample_every_s:  # polled often: no fault starts past the end
                sampled = _now()
                try:
                    samples.append(sample(swarm))
                except Exception as exc:
                    print(f"[soak] sample failed: {exc}", flush=True)
            time.sleep(0.2)
        nemesis.stop.set()
        nem.join(300)  # the fault in progress is undone and its recovery timed
        setup["faults_s"] = round(_now() - started, 1)
        load.stop.set()
        for t in threads:
            t.join(load.timeout_s + 30)
        setup["drain_s"] = round(_now() - started - setup["faults_s"], 1)  # the requests in flight finishing
        for o in load.outcomes:
            if o.kind == "pending":
                o.kind, o.error = "hung", "the client thread never returned"
        ended = _now()
        health = [swarm.get("/health"), *(httpx.get(b + "/health", timeout=30).json() for b in swarm.bases[1:])]
        report = summarise(load.outcomes, refs, nemesis.faults, nemesis.fault_windows, samples,
                           warmup_s if warmup_s is not None else min(120.0, duration_s / 4), health,
                           swarm.liar_id, started, ended)
        report["nat_relayed"] = swarm.nat_relayed()
        setup["waves_s"] = swarm.waves_s
        stopping = _now()
    setup["teardown_s"] = round(_now() - stopping, 1)
    report["seed"], report["clients"], report["verify_rate"] = seed, clients, verify_rate
    report["setup"], report["wall_s"] = setup, round(_now() - t0, 1)
    loads = sorted(x["load1"] for x in samples) or [os.getloadavg()[0]]
    report["load1"] = {"min": loads[0], "median": loads[len(loads) // 2], "max": loads[-1]}
    report["problems"] = check(report)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the model GGUF (default: make-model's tiny preset, f32)")
    ap.add_argument("--workdir", default="/tmp/soak")
    ap.add_argument("--duration-s", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every-s", type=float, default=30)
    ap.add_argument("--verify-rate", type=float, default=0.25)
    ap.add_argument("--hold-scale", type=float, default=1.0,
                    help="scale every fault's hold (partitions 20-60 s, SIGSTOP 5-15 s, ...) by this")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args()
    workdir = Path(args.workdir)

    def interrupted(signum, _frame):  # SIGTERM, or SIGINT in a background job (ignored there by default)
        raise SystemExit(128 + signum)  # unwinds through Swarm.__exit__: processes stopped, namespaces deleted

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        report = run_soak(args.model, workdir, duration_s=args.duration_s, seed=args.seed, clients=args.clients,
                          fault_every_s=args.fault_every_s, verify_rate=args.verify_rate,
                          hold_scale=args.hold_scale)
    finally:
        if not args.keep:
            shutil.rmtree(workdir / "swarm" / "cache", ignore_errors=True)
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    for p in report["problems"]:
        print("PROBLEM:", p)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
