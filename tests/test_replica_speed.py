"""Replicas of the same experts share a layer's groups by measured speed (Dispatcher._finish_s):
a faster replica gets more, a slow one still some (asked again at least every ``replica_probe_s``), and the outputs are the same bits whoever
computes. In process (owners paced per pair) and as real processes, each worker in its own CPU
cgroup (bench/cpu_groups.py: separate weak devices, needs root)."""
from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest
import trio

from conftest import REPO
from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.runner import Backbone
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.slicer import slice_experts
from p2pswarm.net.signed.identity import load_or_create_identity
from p2pswarm.worker.expert_worker import ExpertWorker

sys.path.insert(0, str(REPO / "bench"))
from cpu_groups import CgroupError, CpuGroups
from wan_swarm import WanSwarm

TOKENS = [17, 3, 250, 99, 4, 4, 301, 12, 40, 41, 7, 9]


class _PacedOwner(InProcessOwner):
    """A replica that takes ``per_pair_s`` for every (expert, row) pair it is sent: a device of
    that speed (the dispatcher measures it from the round trips, as it would a worker process's)."""

    def __init__(self, worker, name, per_pair_s):
        super().__init__(worker, name)
        self.per_pair_s = per_pair_s

    async def compute(self, layer, cur, groups, family=None):
        await trio.sleep(self.per_pair_s * sum(len(idx) for _, idx in groups))
        return await super().compute(layer, cur, groups, family)


async def test_replicas_share_groups_by_measured_speed_and_stay_exact(tiny_f32, tmp_path):
    layout = ModelLayout.open(tiny_f32)
    full = tmp_path / "all.gguf"
    slice_experts(tiny_f32, full, None, (0, layout.n_expert))
    mono = Backbone(load_dense(layout), Dispatcher(make_bank(layout, "numpy")))
    want = await mono.forward(TOKENS, mono.new_state())
    shares = {}
    for paces in ((0.0005, 0.0005), (0.0005, 0.002)):
        owners = [_PacedOwner(ExpertWorker(full, kernel="numpy"), f"w{i}", p) for i, p in enumerate(paces)]
        disp = Dispatcher(make_bank(layout, "numpy"), owners)
        bb = Backbone(load_dense(layout), disp)
        for _ in range(3):
            got = await bb.forward(TOKENS, bb.new_state())
            assert np.array_equal(got, want)  # same bits whoever computed
        assert disp.stats.local_groups == 0 and disp.stats.fallbacks == 0
        rows = disp.stats.per_owner_rows
        shares[paces] = rows["w0"] / (rows["w0"] + rows["w1"])
        assert disp.owner_row_s["w0"] > 0 and disp.owner_row_s["w1"] > 0
    # equal devices: both used (the first listed used to take every group of a shared expert)
    assert 0.3 <= shares[(0.0005, 0.0005)] <= 0.7, shares
    # one 4x slower: the fast one takes most (the split follows measured speed), the slow one some
    assert shares[(0.0005, 0.002)] >= 0.65, shares


async def test_a_replica_measured_slow_is_asked_again_after_the_probe_interval(tiny_f32, tmp_path):
    """Replicas share by measured speed, so one measured 100x slower gets no group while the fast
    one is healthy: without a re-measure it would never be asked again (a phone's momentary load,
    a throttled CPU period). After ``replica_probe_s`` with no group it gets one, then none."""
    layout = ModelLayout.open(tiny_f32)
    full = tmp_path / "all.gguf"
    slice_experts(tiny_f32, full, None, (0, layout.n_expert))
    owners = [_PacedOwner(ExpertWorker(full, kernel="numpy"), f"w{i}", 0.0) for i in range(2)]
    disp = Dispatcher(make_bank(layout, "numpy"), owners)
    disp.owner_row_s.update({"w0": 1e-5, "w1": 1e-3})
    groups = [(e, np.arange(2)) for e in range(layout.n_expert)]
    disp.replica_probe_s = 0.2
    for _ in range(2):
        plan = disp.assign(0, groups)
        assert len(plan[owners[1]]) == 1 and len(plan[owners[0]]) == len(groups) - 1  # one group: a probe
        assert set(disp.assign(0, groups)) == {owners[0]}  # then the measured speeds decide again
        await trio.sleep(0.25)


N = 8
MAX_TOKENS = 8


def _complete(base_url: str) -> list[str]:
    """N concurrent greedy completions: their texts in prompt order."""
    import http.client

    host = base_url.split("://", 1)[-1]
    texts: list[str | None] = [None] * N

    def client(i: int) -> None:
        c = http.client.HTTPConnection(host, timeout=300)
        c.request("POST", "/v1/completions", json.dumps({"prompt": f"device {i} asks", "max_tokens": MAX_TOKENS,
                                                         "temperature": 0}), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        texts[i] = json.loads(r.read())["choices"][0]["text"]
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(t is not None for t in texts)
    return texts  # type: ignore[return-value]


@pytest.mark.slow
def test_requests_move_to_the_faster_device_in_cgroups(tiny_f32, tmp_path):
    """Two worker processes holding every expert, one in a CPU cgroup of 0.05 of a core, one of
    0.5: the faster gets most of the (expert, row) pairs (the backbone's own counts), the slower
    still some, no fallbacks, and the texts equal the backbone alone's."""
    try:
        groups = CpuGroups()
    except CgroupError as exc:
        pytest.fail(f"{exc}", pytrace=False)
    quotas = {"w0": 0.05, "w1": 0.5}
    with groups:
        def place(name, proc):
            if name in quotas:
                groups.make(f"test-{name}", quotas[name]).add(proc.pid)

        with WanSwarm(tiny_f32, ranges=[], rtt_ms=0, workdir=tmp_path / "alone", timeout_s=30) as alone:
            want = _complete(alone.base_url)
        with WanSwarm(tiny_f32, ranges=[(0, 16), (0, 16)], rtt_ms=0, workdir=tmp_path / "swarm", timeout_s=30,
                      on_start=place) as sw:
            sw.wait_covered()
            _complete(sw.base_url)  # every owner measured
            d0 = sw.swarm()["dispatch"]
            got = _complete(sw.base_url)
            d1 = sw.swarm()["dispatch"]
            names = {w["name"]: w for w in sw.swarm()["workers"]}
        paths = [g.path for g in groups.groups]
    assert not any(p.exists() for p in paths)  # the groups are removed with the run
    assert got == want
    assert d1["fallbacks"] == d0["fallbacks"] and d1["local_groups"] == d0["local_groups"]
    rows = {names[k]["peer"]: v - d0["owner_rows"].get(k, 0) for k, v in d1["owner_rows"].items()}
    # which worker is which: its peer id, from the identity file WanSwarm gave it
    slow, fast = (load_or_create_identity(tmp_path / "swarm" / f"{w}.key").peer_id_str for w in ("w0", "w1"))
    assert set(rows) == {slow, fast}
    assert rows[fast] > 2 * rows[slow] > 0, rows


@pytest.mark.slow
def test_per_worker_rtt_puts_a_link_in_front_of_each_worker(tiny_f32, tmp_path):
    """bench/wan_swarm.py's ``worker_rtt_ms`` (device_swarm.py ``--worker-rtt-ms``): one WAN proxy
    per worker link at that worker's RTT, none at 0 ms. The backbone measures the difference in
    its round trips, sends most pairs to the near replica, and the texts equal the backbone alone's."""
    with WanSwarm(tiny_f32, ranges=[], rtt_ms=0, workdir=tmp_path / "alone", timeout_s=30) as alone:
        want = _complete(alone.base_url)
    with WanSwarm(tiny_f32, ranges=[(0, 16), (0, 16)], rtt_ms=0, workdir=tmp_path / "swarm", timeout_s=30,
                  proxies="per-link", worker_rtt_ms=[0, 80]) as sw:
        assert len(sw.proxies) == 1  # w1's link only
        sw.wait_covered()
        _complete(sw.base_url)  # every owner measured
        d0 = sw.swarm()["dispatch"]
        got = _complete(sw.base_url)
        snap = sw.swarm()
        d1 = snap["dispatch"]
    rtt = {w["peer"]: w["rtt_ms"] for w in snap["workers"]}
    near, far = (load_or_create_identity(tmp_path / "swarm" / f"{w}.key").peer_id_str for w in ("w0", "w1"))
    assert got == want
    assert d1["fallbacks"] == d0["fallbacks"]
    assert rtt[far] >= 80 > rtt[near], rtt
    rows = {w["peer"]: d1["owner_rows"].get(w["name"], 0) - d0["owner_rows"].get(w["name"], 0) for w in snap["workers"]}
    assert rows[near] > rows[far], rows
    with pytest.raises(ValueError):
        WanSwarm(tiny_f32, ranges=[(0, 16)], rtt_ms=0, workdir=tmp_path / "x", worker_rtt_ms=[10])


@pytest.mark.slow
def test_per_worker_upload_caps_put_a_capped_link_in_front_of_each_capped_worker(tiny_f32, tmp_path):
    """bench/wan_swarm.py's ``worker_up_mbps`` (device_swarm.py ``--worker-up-mbps 0,20``): worker
    i's upload capped at the i-th value, cycled; a link of 0 ms and no cap has no proxy, a capped
    one has (its worker -> backbone direction capped). The texts equal the backbone alone's."""
    with WanSwarm(tiny_f32, ranges=[], rtt_ms=0, workdir=tmp_path / "alone", timeout_s=30) as alone:
        want = _complete(alone.base_url)
    with WanSwarm(tiny_f32, ranges=[(0, 16), (0, 16)], rtt_ms=0, workdir=tmp_path / "swarm", timeout_s=30,
                  proxies="per-link", worker_up_mbps=[0, 20]) as sw:
        assert len(sw.proxies) == 1  # w1's link only
        cmd = sw.proxies[0].proc.args
        assert float(cmd[cmd.index("--down-mbps") + 1]) == 20 and float(cmd[cmd.index("--rtt-ms") + 1]) == 0
        sw.wait_covered()
        got = _complete(sw.base_url)
    assert got == want
    with pytest.raises(ValueError):
        WanSwarm(tiny_f32, ranges=[(0, 16)], rtt_ms=0, workdir=tmp_path / "x", worker_up_mbps=[10])
