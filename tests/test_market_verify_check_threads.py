"""The verifier's spot checks run their ggml graphs on one thread (``CHECK_THREADS``): a check hides
behind the round trip of the request it checks, so a second thread bought no time and cost the
backbone's CPU (docs/benchmarks.md, "A spot check's CPU"). The check stays strict: the replica on one
thread must give the bits a worker on two threads gives, and a worker that flips one bit is caught."""
from __future__ import annotations

import numpy as np

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.dispatch.verify import CHECK_THREADS
from p2pswarm.backbone.sessions.local import ensure_shards
from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine.ggml.cpu_share import GRAPH_THREAD_CAP
from p2pswarm.engine.kernels import make_bank
from p2pswarm.market.verify import Verifier
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.ggml import needs_ggml


class OneBitLiar(ExpertWorker):
    """Honest for ``honest_rows`` rows, then flips the lowest mantissa bit of one element of every group."""

    def __init__(self, shard, *, honest_rows: int, **kw):
        super().__init__(shard, **kw)
        self.honest_rows, self.rows, self.lies = honest_rows, 0, 0

    def compute(self, layer, rows, groups, family=None):
        outs = super().compute(layer, rows, groups, family)
        for out in outs:
            if self.rows >= self.honest_rows and len(out):
                out.view(np.uint32)[0, 0] ^= np.uint32(1)
                self.lies += 1
            self.rows += len(out)
        return outs


@needs_ggml
async def test_spot_checks_run_on_one_thread_and_still_catch_a_one_bit_lie(tiny_q8, tmp_path, monkeypatch):
    layout = ModelLayout.open(tiny_q8)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    bank = make_bank(layout, "ggml", threads=2)
    honest = ExpertWorker(shards[0], kernel="ggml", threads=2)
    liar = OneBitLiar(shards[1], kernel="ggml", threads=2, honest_rows=400)
    # every CPU free and any graph worth two threads: only the checks' cap can say one
    monkeypatch.setattr(ggml_runner, "free_cpus", lambda: 2)
    monkeypatch.setattr(ggml_runner, "MIN_MACS_PER_THREAD", 1)
    lib = bank.runner.lib
    real_set = lib.backend_cpu_set_n_threads
    threads_of: dict[int, list[int]] = {}

    def spy(backend, n):
        threads_of.setdefault(int(backend), []).append(int(n))
        return real_set(backend, n)

    monkeypatch.setattr(lib, "backend_cpu_set_n_threads", spy)
    replica, worker_side = int(bank.runner._backend), int(honest.bank.runner._backend)
    disp = Dispatcher(bank, [InProcessOwner(honest, "h"), InProcessOwner(liar, "liar")])
    disp.verifier = Verifier(0.2, seed=3)
    seen: list = []
    disp.on_mismatch = lambda peer, ev: seen.append(ev)
    rng = np.random.default_rng(4)
    steps, before_detection = 0, []
    while not seen:
        before_detection = list(threads_of.get(replica, []))  # the replica's graphs so far: checks only
        cur = rng.standard_normal((64, 256)).astype(np.float32)
        picks = np.stack([rng.choice(layout.n_expert, 4, replace=False) for _ in range(64)])
        groups = [(int(e), np.flatnonzero((picks == e).any(axis=1)).astype(np.int64)) for e in np.unique(picks)]
        layer = int(rng.integers(0, len(layout.expert_layers)))
        outs = await disp.run_groups(layer, cur, groups)
        if seen:  # the detecting step: the replica's bits for every group
            assert all(np.array_equal(o, w) for o, w in zip(outs, bank.forward_groups(layer, cur, groups)))
        steps += 1
        assert steps < 500, "the one-bit liar was never caught"
    assert GRAPH_THREAD_CAP.get() is None  # the checks' cap stayed in their own tasks
    ev = seen[0]
    assert ev.worker == "liar" and ev.rows_differing >= 1 and 0 < ev.max_abs_delta < 1e-3
    assert disp.bans.banned.keys() == {"liar"} and liar.lies > 0
    # the honest worker computed on two threads, the replica's checks on one, and no bit differed
    assert "h" not in disp.bans.banned and disp.verifier.rows_checked["h"] > 0
    assert 2 in threads_of[worker_side]
    assert before_detection and set(before_detection) == {CHECK_THREADS}, before_detection
    # outside a check the replica's graphs still use both threads (the cap is the checks' alone):
    # the detecting step's recomputation of the liar's groups, and a call made here
    n_before = len(threads_of[replica])
    bank.forward_groups(0, rng.standard_normal((8, 256)).astype(np.float32), [(0, np.arange(8))])
    assert threads_of[replica][n_before:] == [2] and 2 in threads_of[replica][len(before_detection):n_before]
