"""Self-enrolment: which coverage units a worker holds, given demand, coverage and its memory.

:func:`choose_units` is the whole decision, a pure function over arrays indexed by unit: the node
(`node --role worker --auto`, :mod:`p2pswarm.market.auto`) and ``bench/market_sim.py`` call this
very function, so the simulation measures the code that runs.

The problem is a knapsack: maximise the summed reward (:func:`p2pswarm.market.reward.reward`) of
the units held, subject to their bytes fitting the budget. Units of one model are (nearly) the
same size, for which taking units in order of reward per byte is optimal; for unequal sizes it is
the usual greedy approximation. Units need not be contiguous: any (layer, block) set is allowed.

Three things keep a crowd of workers sane:

* **Marginal replicas.** A unit this worker holds is judged by the replicas *others* provide
  (``replicas - 1``): its reward is what this worker's copy adds, so two holders of a unit both
  see it as "one other replica", i.e. worth keeping, and neither leaves it for an equal unit.
* **Hysteresis.** A held unit is dropped only for a unit whose reward per byte is more than
  ``1 + hysteresis`` times its own (default 25 %): small swings of decayed demand never make a
  worker throw away a download. A held unit is kept first, whatever happens elsewhere, as long as
  the budget holds it.
* **Randomised choice within a tier.** New units are taken in the order of a weighted random
  sample without replacement (Efraimidis-Spirakis keys ``log(u) / w``), not by strict rank: a
  hundred workers that join at once and see the same empty map spread over the units in
  proportion to their reward instead of all taking the same hottest ones. The scarcity tiers are
  10^4 apart, so a scarcer unit still comes first with probability > 0.9999; ties and near-ties
  are broken at random.
* **Randomised drops.** Every holder of a unit with ``r`` live replicas sees "``r - 1`` others":
  if all of them left it for something scarcer at once, it would fall from ``r`` to 0. So a worker
  gives a held unit up for a better one only with probability ``(r - KEEP) / r`` (``KEEP`` = 3, the
  target plus one spare against churn): of the ``r`` holders deciding on the same map, ``r - KEEP``
  are expected to leave. Scarce units are then filled by free memory (newcomers, grown budgets)
  and by holders of crowded units.
* **Rebalancing when memory is short.** A unit at ``KEEP`` or fewer replicas is left only for a
  unit short of TARGET with at least two replicas fewer (3 -> 2 for 1 -> 2, or 2 -> 1 for 0 -> 1:
  the spread shrinks, nothing falls below what it gives), each holder with probability ``1 / r``
  (about one of the ``r`` holders a period, then damped by the swap rule below). Without it a full
  swarm can stick: when every slot is taken and the spare replicas sit on units at exactly
  ``KEEP``, nobody may move, and a unit stays at one replica for good (the process test saw
  replicas ``[2, 3, 3, 3, 2, 3, 1, 3]`` in 20 slots for 8 units, unchanged for three minutes).
* **Randomised swaps into scarce units.** The mirror image: when a handful of units fall short,
  every worker of the swarm sees them at once, and all would swap into them (the simulation saw
  one unit collect 579 replicas in a round). So a worker swaps a held unit for one with
  ``others < KEEP`` only with probability ``(KEEP - others) / crowd``, ``crowd`` being the workers
  deciding on the same map (the node passes the live workers it sees): about ``KEEP - others``
  of them take it per period; for a covered unit the probability is ``1 / crowd`` (about one
  mover a period: at 10,000 phones, undamped swaps between covered units moved 2.4 units per phone
  per round for small reward gains). Free memory takes scarce units without this damping (newcomers
  are few, and an unneeded replica there is cheap: it is shed later).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from p2pswarm.market.reward import TARGET, reward

DEFAULT_HYSTERESIS = 0.25
KEEP = 3  # a held unit with this many live replicas or fewer is given up only to rebalance (module doc)


@dataclass(frozen=True)
class Enrolment:
    """A decision: the units to hold (indices, sorted), and what changed against ``held``."""

    units: tuple[int, ...]
    added: tuple[int, ...]
    dropped: tuple[int, ...]
    bytes: int
    reward: float


def choose_units(*, demand, replicas, sizes, budget: int, held=(), rng: np.random.Generator,
                 hysteresis: float = DEFAULT_HYSTERESIS, crowd: int = 1) -> Enrolment:
    """The units a worker with ``budget`` bytes should hold.

    ``demand[i]``: unit i's demand (any non-negative scale: it is normalised); ``replicas[i]``:
    its live replicas as the coverage map shows them, *including* this worker for units in
    ``held``; ``sizes[i]``: its bytes; ``crowd``: how many workers decide on this same map (1:
    none but us). Returns an :class:`Enrolment` (see the module doc)."""
    demand = np.asarray(demand, dtype=np.float64)
    replicas = np.asarray(replicas, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    n = len(sizes)
    if demand.shape != (n,) or replicas.shape != (n,):
        raise ValueError(f"demand {demand.shape}, replicas {replicas.shape} and sizes {sizes.shape} differ")
    if hysteresis < 0:
        raise ValueError("hysteresis must be >= 0")
    held_set = sorted({int(i) for i in held if 0 <= int(i) < n})
    is_held = np.zeros(n, dtype=bool)
    is_held[held_set] = True
    others = np.maximum(replicas - is_held, 0.0)
    w = reward(demand, others)
    density = w / np.maximum(sizes, 1.0)

    # Keep what we hold, best first, as long as it fits (the budget may have shrunk).
    keep: list[int] = []
    free = float(budget)
    for i in sorted(held_set, key=lambda i: -density[i]):
        if sizes[i] <= free:
            keep.append(i)
            free -= sizes[i]

    # Candidates in weighted-random order: Efraimidis-Spirakis keys log(u)/w, largest first.
    cand = np.flatnonzero(~is_held)
    u = rng.random(len(cand))
    keys = np.log(np.maximum(u, 1e-300)) / np.maximum(density[cand], 1e-300)
    order = cand[np.argsort(-keys, kind="stable")]

    chosen = set(keep)
    # A held unit is swapped for one short of KEEP replicas with probability need / crowd: of
    # ``crowd`` workers deciding on the same map, about ``need`` do it (module doc).
    need = np.maximum(KEEP - others, 1.0)  # a covered unit: about one mover a period, not a stampede
    take_p = np.minimum(1.0, need / max(1, crowd))
    passed = rng.random(n) < take_p
    # Fill free space first, then consider swaps against the weakest kept unit.
    smallest = float(sizes.min()) if n else 0.0
    pos = 0
    while pos < len(order) and free >= smallest:
        i = int(order[pos])
        if sizes[i] <= free:
            chosen.add(i)
            free -= sizes[i]
        pos += 1
    rest = order[pos:]
    # Held units this worker may give up now (module doc): a surplus unit, with probability
    # (r - KEEP) / r, for any better unit; one at KEEP or fewer, with probability 1 / r, only to
    # rebalance: for a unit short of TARGET with at least two replicas fewer than it.
    r_held = {i: max(replicas[i], 1.0) for i in keep}
    surplus = {i for i in keep if rng.random() < (r_held[i] - KEEP) / r_held[i]}
    rebalance = {i for i in keep if r_held[i] <= KEEP and rng.random() < 1.0 / r_held[i]}
    droppable = sorted(surplus | rebalance, key=lambda i: density[i])
    for c in rest[passed[rest]] if droppable else ():
        c = int(c)
        for k in droppable:
            if density[c] <= (1.0 + hysteresis) * density[k] or sizes[c] > free + sizes[k]:
                continue  # candidates are not sorted strictly by density: look at the next ones too
            if k in surplus or (others[c] < TARGET and others[c] <= r_held[k] - 2):
                chosen.discard(k)
                chosen.add(c)
                free += sizes[k] - sizes[c]
                droppable.remove(k)
                break
        if not droppable:
            break
    units = tuple(sorted(chosen))
    return Enrolment(units, tuple(sorted(chosen - set(held_set))), tuple(sorted(set(held_set) - chosen)),
                     int(sum(sizes[i] for i in units)), float(sum(w[i] for i in units)))


def random_units(*, sizes, budget: int, rng: np.random.Generator) -> tuple[int, ...]:
    """The baseline: units picked uniformly at random until the budget is full (no market)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    chosen, free = [], float(budget)
    for i in rng.permutation(len(sizes)):
        if sizes[i] <= free:
            chosen.append(int(i))
            free -= sizes[i]
    return tuple(sorted(chosen))
