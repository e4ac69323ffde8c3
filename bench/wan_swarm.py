"""A swarm of real OS processes on 127.0.0.1 with every worker behind a WAN-emulating proxy.

Used by tests/test_throughput_swarm.py and bench/bench_throughput.py:

    with WanSwarm(model, ranges=[(0, 8), (8, 16), (0, 8)], rtt_ms=50, workdir=tmp) as sw:
        sw.base_url            # the backbone's HTTP API
        sw.workers[0].kill()   # kill -9

Layout: a bootstrap node; a ``python -m p2pswarm.net.wire.wanproxy`` process emulating one WAN link in
front of each ``p2pswarm node --role worker`` (one process for all links, or one per link), the
worker listening on a fixed local port and ``--announce`` ing its link's port, so every expert
request the backbone sends crosses the emulated link both ways (at 0 ms RTT no proxy: the worker
announces itself); a ``p2pswarm node --role backbone --http`` that finds the workers through the DHT.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from p2pswarm.model.slicer import slice_experts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.procs import Proc, free_port, free_ports  # the one process helper; also the tests'

__all__ = ["Proc", "WanSwarm", "cpu_seconds", "free_port", "free_ports"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WanSwarm:
    def __init__(self, model: Path, *, ranges: list[tuple[int, int]], rtt_ms: float, workdir: Path,
                 kernel: str = "numpy", backbone_args: list[str] | None = None, timeout_s: float = 5.0,
                 wrapper: str | None = None, threads: int | None = 1, direct: bool = False,
                 proxy_at_zero: bool = False, proxies: str = "shared", proxy_args: list[str] | None = None,
                 backbone_model: Path | None = None, on_start=None, worker_rtt_ms: list[float] | None = None,
                 worker_up_mbps: list[float] | None = None):
        """``wrapper``: a script run instead of ``-m MODULE`` as ``python WRAPPER MODULE args`` for every
        node and proxy (bench/trace_entry.py: per-hop timestamps). ``threads``: every node's kernel
        threads (``P2PSWARM_THREADS``; 1: ten processes share this machine's cores; ``None``: the
        default, all cores, for a backbone alone). ``ranges=[]``: no workers, the backbone computes
        every expert itself (the backbone-alone baseline, through the same HTTP API). ``direct``:
        every worker also offers a direct lane (``--direct``), behind a link of its own with the
        same RTT (``--direct-announce`` names it), so expert requests skip py-libp2p but not the link.
        ``proxy_at_zero``: a proxy even at ``rtt_ms=0`` (by default a 0 ms swarm has none);
        ``proxies``: ``"shared"`` (one proxy process for every link) or ``"per-link"`` (one each;
        see :meth:`_proxies`); ``proxy_args``: more ``wanproxy`` arguments (bandwidth caps: with one
        proxy process, ``--shared-*-mbps`` caps every link together, as the backbone's own line).
        ``backbone_model``: the backbone's ``--model`` when not ``model`` (the backbone file of
        `slice --backbone`, bench/bench_expert_cache.py); the workers' shards are cut from ``model``.
        ``on_start(name, proc)``: called once each node is READY ("boot", "w0", ..., "backbone"):
        bench/device_swarm.py moves it into a CPU cgroup there. Workers of the same expert range
        (replicas) share one slice file (a hard link): the 122B geometry's slices are GBs.
        ``worker_rtt_ms``: worker i's link RTT is ``worker_rtt_ms[i % len]`` instead of ``rtt_ms``
        (with ``proxies="per-link"``: one proxy each; a link of 0 ms has none, as above).
        ``worker_up_mbps``: worker i's upload (its links' worker -> backbone direction, libp2p and
        direct lane) is capped at ``worker_up_mbps[i % len]`` Mbit/s, 0: none (per-link proxies;
        a capped link of 0 ms gets one too)."""
        if proxies not in ("shared", "per-link"):
            raise ValueError("proxies must be 'shared' or 'per-link'")
        if (worker_rtt_ms or worker_up_mbps) and proxies != "per-link":
            raise ValueError("worker_rtt_ms and worker_up_mbps need proxies='per-link' (one link, one RTT and cap)")
        self.worker_rtt_ms = list(worker_rtt_ms or [])
        self.worker_up_mbps = list(worker_up_mbps or [])
        self.proxy_mode = proxies
        self.model = Path(model)
        self.backbone_model = Path(backbone_model) if backbone_model is not None else self.model
        self.ranges = ranges
        self.rtt_ms = rtt_ms
        self.dir = Path(workdir)
        self.kernel = kernel
        self.backbone_args = backbone_args or []
        self.timeout_s = timeout_s
        self.env = dict(os.environ, P2PSWARM_KERNEL=kernel, P2PSWARM_HOME=str(self.dir / "home"))
        if threads is None:
            self.env.pop("P2PSWARM_THREADS", None)
        else:
            self.env["P2PSWARM_THREADS"] = str(threads)
        self.procs: list[Proc] = []
        self.workers: list[Proc] = []
        self.proxies: list[Proc] = []
        self.wrapper = wrapper
        self.direct = direct
        self.proxy_at_zero = proxy_at_zero
        self.proxy_args = proxy_args or []
        self.on_start = on_start
        self._slices: dict[tuple[int, int], Path] = {}

    def _entry(self, module: str) -> list[str]:
        return [self.wrapper, module] if self.wrapper else ["-m", module]

    def _node(self, name: str, args: list[str]) -> Proc:
        p = Proc(args, self.dir / f"{name}.log", self.env, entry=self._entry("p2pswarm.cli"))
        self.procs.append(p)
        if self.on_start is not None:
            self.on_start(name, p)
        return p

    def _proxies(self, target_ports: list[int], link_ports: list[int]) -> list[int]:
        """The ports at which the targets (127.0.0.1:port each) are reached: WAN links of this
        swarm's RTT in front of them, all in one ``wanproxy`` process (``proxies="shared"``, the
        default) or one process per link (``"per-link"``). At 0 ms (unless ``proxy_at_zero``)
        none: the targets' own ports. The emulated network should cost the cores the swarm shares
        as little as possible, as a real one costs the nodes nothing: a link with no delay is
        loopback (a proxy there emulates nothing but costs every request two more process
        wake-ups: an echo through a 0 ms proxy took 0.08 ms on one VM of this kind, 1.1 ms median
        on another), and one process for every link wakes once for the chunks that cross several
        links at the same moment (a layer's requests to every owner), not once per link."""
        if self.worker_rtt_ms or self.worker_up_mbps:  # per worker: link k is worker k's (its direct lane's: k - n)
            n = len(self.ranges)

            def each(values: list[float], default: float, k: int) -> float:
                return values[(k % n) % len(values)] if values else default
            reach = []
            for k, (t, lp) in enumerate(zip(target_ports, link_ports)):
                rtt, up = each(self.worker_rtt_ms, self.rtt_ms, k), each(self.worker_up_mbps, 0.0, k)
                if rtt == 0 and not up and not self.proxy_at_zero:  # (a cap in proxy_args: pass proxy_at_zero)
                    reach.append(t)
                    continue
                cap = ["--down-mbps", str(up)] if up else []
                proxy = Proc(["--target", f"127.0.0.1:{t}", "--listen", f"127.0.0.1:{lp}", "--rtt-ms", str(rtt),
                              *cap, *self.proxy_args], self.dir / f"proxy{k}.log", self.env,
                             entry=self._entry("p2pswarm.net.wire.wanproxy"))
                self.procs.append(proxy)
                self.proxies.append(proxy)
                reach.append(lp)
            return reach
        if not target_ports or (self.rtt_ms == 0 and not self.proxy_at_zero):
            return list(target_ports)
        # the links' ports (``link_ports``) are chosen with the targets' (all distinct), not left to
        # the proxy's own port-0 binds: those may take a target port chosen but not yet bound
        pairs = list(zip(target_ports, link_ports))
        groups = [pairs] if self.proxy_mode == "shared" else [[p] for p in pairs]
        for k, group in enumerate(groups):
            args = [a for t, lp in group for a in ("--target", f"127.0.0.1:{t}", "--listen", f"127.0.0.1:{lp}")]
            proxy = Proc([*args, "--rtt-ms", str(self.rtt_ms), *self.proxy_args], self.dir / f"proxy{k}.log", self.env,
                         entry=self._entry("p2pswarm.net.wire.wanproxy"))
            self.procs.append(proxy)
            self.proxies.append(proxy)
        return list(link_ports)

    def __enter__(self) -> "WanSwarm":
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.boot = self._node("boot", ["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0",
                                            "--identity", str(self.dir / "boot.key")])
            n = len(self.ranges)
            links = n * (2 if self.direct else 1)
            chosen = free_ports(2 * links)  # each worker's port(s), then their links' ports
            ports, dports = chosen[:n], chosen[n:links]
            reach = self._proxies(chosen[:links], chosen[links:])
            for i, (e0, e1) in enumerate(self.ranges):
                shard = self.dir / f"shard{i}-{e0}-{e1}.gguf"
                if not shard.exists():
                    same = self._slices.get((e0, e1))
                    if same is not None:
                        os.link(same, shard)
                    else:
                        slice_experts(self.model, shard, None, (e0, e1))
                self._slices[(e0, e1)] = shard
                lane = []
                if self.direct:
                    lane = ["--direct", f"127.0.0.1:{dports[i]}", "--direct-announce", f"127.0.0.1:{reach[n + i]}"]
                self.workers.append(self._node(f"w{i}", [
                    "node", "--role", "worker", "--shard", str(shard), "--bootstrap", self.boot.ready[0],
                    "--listen", f"/ip4/127.0.0.1/tcp/{ports[i]}", "--announce", f"/ip4/127.0.0.1/tcp/{reach[i]}",
                    "--identity", str(self.dir / f"w{i}.key"), "--ttl", "300", "--kernel", self.kernel, *lane]))
            self.backbone = self._node("backbone", [
                "node", "--role", "backbone", "--model", str(self.backbone_model), "--bootstrap", self.boot.ready[0],
                "--http", "127.0.0.1:0", "--identity", str(self.dir / "backbone.key"), "--kernel", self.kernel,
                "--timeout", str(self.timeout_s),
                # the load generators send every request from 127.0.0.1 (one client to the limits),
                # up to 64 at once and more: the per-client and total caps must not refuse them
                "--max-requests-per-client", "1024", "--max-requests", "1024", *self.backbone_args])
            http = next(w for w in self.backbone.ready if w.startswith("http="))[5:]
            self.base_url = "http://" + http.replace("0.0.0.0", "127.0.0.1").split("://")[-1]
        except BaseException:
            self.__exit__()
            raise
        return self

    def get(self, path: str) -> dict:
        """The backbone's JSON answer to ``GET path`` (``/health``, ``/v1/swarm``, ...)."""
        with urllib.request.urlopen(self.base_url + path, timeout=60) as r:
            return json.load(r)

    def swarm(self) -> dict:
        """The backbone's ``GET /v1/swarm``: coverage units, the workers it sees, dispatch counters."""
        return self.get("/v1/swarm")

    def wait_covered(self, timeout_s: float = 60.0) -> None:
        """Until the backbone sees every unit covered by a remote replica and every worker, read from
        its ``/v1/swarm`` (not its start-up log line: a first coverage map that misses a worker whose
        records were not in the DHT yet is completed by a later refresh, which logs nothing)."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            seen = self.swarm()
            if seen["covered_units"] == len(seen["units"]) and len(seen["workers"]) >= len(self.ranges):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the backbone never saw full coverage: {seen and seen['covered_units']} of "
                           f"{seen and len(seen['units'])} units, {seen and len(seen['workers'])} workers; "
                           + self.backbone.log.read_text()[-2000:])

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            p.stop()
