"""The coverage market under churn: simulated phones running the real enrolment code.

Every phone calls :func:`p2pswarm.market.enrol.choose_units` (the function `node --role worker
--auto` calls; imported, not copied) on the 122B's geometry: 49 layers x 256 experts, blocks of 8
experts (1,568 units), 5.25 MB per expert, so 42 MB per unit. Budgets are uniform in 42-340 MB
(1-8 units). Sessions are exponential with a mean that makes ``--churn`` of the phones leave each
round; every leaver is replaced by a newcomer, so the population stays at ``--phones``. Demand is
Zipf(``--zipf``) over each layer's experts, in a random rank order per layer.

A round is one re-evaluation period: (1) phones whose session ended leave - their units vanish at
once (as a killed worker's record expires); (2) *every* phone evaluates, in random order, in
``--waves`` waves: a wave decides on the coverage that the earlier waves left (with 10 waves a
phone's choice becomes visible to others a tenth of a period later - its download and record;
with 1 wave all phones decide on the same snapshot, the worst case for herding). The fraction of
units with >= 2 live replicas is measured right after the departures (the worst moment) and at the
end of the round. The baseline, random placement, runs the same phones, sessions and seeds, each
phone picking random units until its budget is full and never moving.

    python bench/market_sim.py --phones 1000,10000 --rounds 40 --write
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import REPO, header, publish  # puts the repo on sys.path

from p2pswarm.market.enrol import choose_units, random_units

LAYERS, EXPERTS, BLOCK = 49, 256, 8
EXPERT_MB = 5.25
UNIT_BYTES = int(BLOCK * EXPERT_MB * 1e6)
BUDGET_MB = (42, 340)


def unit_demand(rng: np.random.Generator, zipf: float) -> np.ndarray:
    ranks = np.arange(1, EXPERTS + 1, dtype=np.float64)
    per = ranks ** -zipf
    out = []
    for _ in range(LAYERS):
        experts = per[rng.permutation(EXPERTS)]
        out.append(experts.reshape(-1, BLOCK).sum(axis=1))
    return np.concatenate(out)


def simulate(*, phones: int, rounds: int, churn: float, zipf: float, seed: int, market: bool, waves: int) -> dict:
    rng = np.random.default_rng(seed)
    life_rng = np.random.default_rng(seed + 1)  # the same sessions and budgets for both placements
    n_units = LAYERS * (EXPERTS // BLOCK)
    sizes = np.full(n_units, UNIT_BYTES)
    demand = unit_demand(np.random.default_rng(seed + 2), zipf)
    mean_session = -1.0 / np.log(1.0 - churn)  # rounds; P(leave in a round) = churn

    def newcomer() -> dict:
        budget = int(life_rng.uniform(*BUDGET_MB) * 1e6)
        return {"budget": budget, "left": life_rng.exponential(mean_session), "units": (), "pending": ()}

    pop = [newcomer() for _ in range(phones)]
    after_leave, end_of_round, moves, departures = [], [], [], []
    t0 = time.perf_counter()
    for _ in range(rounds):
        # 1. departures
        gone = 0
        for i, p in enumerate(pop):
            p["left"] -= 1.0
            if p["left"] <= 0:
                pop[i] = newcomer()
                gone += 1
        departures.append(gone)
        live = np.zeros(n_units)
        for p in pop:
            live[list(p["units"])] += 1
        after_leave.append(float((live >= 2).mean()))
        # 2. everyone decides, wave by wave; a wave sees what the earlier waves decided
        moved = 0
        order = rng.permutation(len(pop))
        for wave in np.array_split(order, waves):
            seen = live.copy()
            for j in wave:
                p = pop[j]
                if market:
                    e = choose_units(demand=demand, replicas=seen, sizes=sizes, budget=p["budget"],
                                     held=p["units"], rng=rng, crowd=len(pop))
                    moved += len(e.added) if p["units"] else 0
                    new = e.units
                elif not p["units"]:
                    new = random_units(sizes=sizes, budget=p["budget"], rng=rng)
                else:
                    new = p["units"]
                live[list(p["units"])] -= 1
                live[list(new)] += 1
                p["units"] = new
        # 3. downloads land: ``live`` now holds every phone's units
        end_of_round.append(float((live >= 2).mean()))
        moves.append(moved)
    return {"after_leave": after_leave, "end": end_of_round, "moves": moves, "departures": departures,
            "seconds": time.perf_counter() - t0, "slots": sum(len(p["units"]) for p in pop), "units": n_units}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phones", default="1000,10000", help="comma-separated populations (default 1000,10000)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--churn", type=float, default=0.10, help="fraction of phones leaving each round (default 0.10)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of expert demand (default 1.0)")
    ap.add_argument("--warmup", type=int, default=10, help="rounds left out of the steady-state numbers (default 10)")
    ap.add_argument("--waves", type=int, default=10,
                    help="decision waves per round, each seeing the earlier ones' choices (default 10; 1: everyone "
                         "decides on the same snapshot, the worst case for herding)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default=None,
                    help="write the plot here (default: docs/market_sim.png with --write, else no plot, so a "
                         "trial run leaves the committed plot alone)")
    ap.add_argument("--write", action="store_true", help="append the results to docs/benchmarks.md")
    args = ap.parse_args()
    pops = [int(x) for x in args.phones.split(",")]
    results: dict[tuple[int, str], dict] = {}
    for n in pops:
        for placement in ("random", "market"):  # baseline and candidate, same seeds, same run
            results[(n, placement)] = simulate(phones=n, rounds=args.rounds, churn=args.churn, zipf=args.zipf,
                                               seed=args.seed, market=placement == "market", waves=args.waves)
            r = results[(n, placement)]
            print(f"{n} phones, {placement}: steady-state end-of-round >=2: "
                  f"{np.mean(r['end'][args.warmup:]):.4f} ({r['seconds']:.0f} s)", flush=True)

    if args.plot is None and args.write:
        args.plot = str(REPO / "docs" / "market_sim.png")
    if args.plot:
        plot(results, args)
    cmd_and_table(results, args, pops)


def plot(results: dict, args) -> None:
    """The coverage per round of every population and placement, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, ((n, placement), r) in enumerate(results.items()):
        color = f"C{k}"
        x = range(1, args.rounds + 1)
        ax.plot(x, np.array(r["end"]) * 100, "-", color=color, label=f"{placement}, {n:,} phones: end of round")
        ax.plot(x, np.array(r["after_leave"]) * 100, ":", color=color, label=f"{placement}, {n:,} phones: after departures")
    ax.axhline(99, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("round (each: ~%d%% of phones leave and are replaced)" % round(args.churn * 100))
    ax.set_ylabel("% of units with >= 2 live replicas")
    ax.set_title("Coverage market vs random placement, 122B geometry (1,568 units of 42 MB)")
    ax.set_ylim(0, 101)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


def cmd_and_table(results: dict, args, pops: list[int]) -> None:
    """The results as a docs/benchmarks.md section, printed, and appended there with --write."""
    w = args.warmup
    cmd = (f"python bench/market_sim.py --phones {args.phones} --rounds {args.rounds} --churn {args.churn} "
           f"--zipf {args.zipf} --waves {args.waves} --seed {args.seed}{' --write' if args.write else ''}")
    lines = [header("Coverage market under churn (simulated phones, the real enrolment code)", cmd),
             f"122B geometry: {LAYERS} layers x {EXPERTS} experts in blocks of {BLOCK} = "
             f"{LAYERS * EXPERTS // BLOCK} units of {UNIT_BYTES / 1e6:.0f} MB; budgets uniform "
             f"{BUDGET_MB[0]}-{BUDGET_MB[1]} MB; exponential sessions, {args.churn:.0%} of phones leave a round "
             f"(replaced); Zipf({args.zipf}) demand. Rounds {w + 1}-{args.rounds} (after {w} warm-up rounds); "
             f"`>= 2 after leave` is measured right after each round's departures, `end` after the round's "
             f"downloads land. Plot: docs/market_sim.png.\n\n",
             "| phones | placement | >= 2 after leave: mean | min | >= 2 end of round: mean | min | "
             "replica slots / unit | units moved per round | sim s |\n|---|---|---|---|---|---|---|---|---|\n"]
    for (n, placement), r in results.items():
        al, end = np.array(r["after_leave"][w:]), np.array(r["end"][w:])
        lines.append(f"| {n:,} | {placement} | {al.mean():.2%} | {al.min():.2%} | {end.mean():.2%} | {end.min():.2%} | "
                     f"{r['slots'] / r['units']:.2f} | {np.mean(r['moves'][w:]):.0f} | {r['seconds']:.0f} |\n")
    for n in pops:
        m, b = results[(n, "market")], results[(n, "random")]
        short_b, short_m = 1 - np.mean(b["after_leave"][w:]), 1 - np.mean(m["after_leave"][w:])
        ratio = "both none" if max(short_b, short_m) < 1e-9 else (
            "market none" if short_m < 1e-9 else f"random / market = {short_b / short_m:.1f}x")
        lines.append(f"\n{n:,} phones: units with < 2 live replicas right after departures: {ratio}.")
    publish("".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
