"""Cost of one status-page poll (``/v1/swarm``'s coverage units) at the 122B's scale.

    python bench/bench_status.py [--workers 50,200,1000] [--experts-per-worker 32] [--append]

The page polls every 2 s and the snapshot is built on the backbone's event loop, so it must stay
small next to a decode step. 49 layers x 256 experts in blocks of 8 (1,568 units); each worker holds
all layers of ``--experts-per-worker`` experts (stripes, wrapping round), a tenth of them in
back-off. Baseline (A): the direct scan, every unit asks every owner whether it holds it
(units x owners). Measured (B): ``SwarmView.units()``, which walks each owner's ranges once.
Alternating A B A B, median of 5 each; the two must agree unit for unit.
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import header, publish

from p2pswarm.backbone.dispatch.dispatcher import DemandCounter, DispatchStats
from p2pswarm.contracts import Owner
from p2pswarm.backbone.api.status_page import SwarmView

LAYERS, N_EXPERT, BLOCK = 49, 256, 8


class FakeOwner(Owner):
    remote = True

    def __init__(self, i: int, e0: int, n: int):
        self.name = f"w{i}"
        self.layers = (0, LAYERS)
        self.experts = (e0, e0 + n)

    def holds(self, layer: int, expert: int) -> bool:
        return self.layers[0] <= layer < self.layers[1] and self.experts[0] <= expert < self.experts[1]


class FakeDispatcher:
    def __init__(self, owners):
        self.owners = owners
        self.stats = DispatchStats()
        self.demand = DemandCounter()
        self.down = {o.name for o in owners[::10]}

    def healthy(self, o) -> bool:
        return o.name not in self.down


def scan(view: SwarmView) -> list[tuple[int, int]]:
    """The baseline: for every unit, every owner."""
    d = view.dispatcher
    out = []
    for layer in view.layers:
        for b in range(view.n_blocks):
            e0, e1 = b * BLOCK, min((b + 1) * BLOCK, N_EXPERT)
            holders = [o for o in d.owners if o.remote and o.layers[0] <= layer < o.layers[1]
                       and o.experts[0] < e1 and e0 < o.experts[1]]
            out.append((sum(d.healthy(o) for o in holders), len(holders)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="50,200,1000")
    ap.add_argument("--experts-per-worker", type=int, default=32)
    ap.add_argument("--append", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        k = args.experts_per_worker
        owners = [FakeOwner(i, (i * k) % (N_EXPERT - k + 1), k) for i in range(n)]
        view = SwarmView(FakeDispatcher(owners), layers=range(LAYERS), n_expert=N_EXPERT, block_size=BLOCK)
        assert [(u["replicas"], u["known"]) for u in view.units()] == scan(view)
        a, b = [], []
        for _ in range(5):
            t = time.perf_counter()
            scan(view)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            view.units()
            b.append(time.perf_counter() - t)
        ma, mb = statistics.median(a), statistics.median(b)
        rows.append((n, ma * 1e3, mb * 1e3, ma / mb))
        print(f"{n:5d} workers: scan {ma * 1e3:8.1f} ms   units() {mb * 1e3:7.1f} ms   scan/units() {ma / mb:5.1f}x")
    cmd = "python bench/bench_status.py" + (f" --workers {args.workers}" if args.workers != "50,200,1000" else "")
    text = header("Status page poll: coverage units at the 122B's scale", cmd)
    text += (f"{LAYERS} layers x {N_EXPERT} experts, blocks of {BLOCK} ({LAYERS * N_EXPERT // BLOCK} units); each worker "
             f"holds all layers of {args.experts_per_worker} experts. Median of 5, alternating A B A B.\n\n"
             "| workers | A: scan, every unit x every owner (ms) | B: SwarmView.units() (ms) | A / B |\n|---|---|---|---|\n")
    text += "".join(f"| {n} | {ma:.1f} | {mb:.1f} | **{r:.1f}** |\n" for n, ma, mb, r in rows)
    publish(text, args.append)


if __name__ == "__main__":
    main()
