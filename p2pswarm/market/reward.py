"""Reward per coverage unit: f(demand, live replicas) - scarcity first, demand second.

    f(d, r) = SCARCITY ** max(0, TARGET - r) * (FLOOR + min(d_hat, DEMAND_CAP)) / (1 + r)

``r`` is the number of *other* live replicas of the unit (a worker judging a unit it holds does
not count itself: the reward is what its replica adds), ``d_hat`` the unit's demand divided by the
mean demand of all units of the model (1.0 = an average unit; all 1.0 when nobody has routed
anything yet).

Why this shape:

* **Scarcity first.** A unit nobody serves costs the backbone a local fallback on every token that
  routes there, and a unit with one replica is one departure from that; an extra replica of a hot
  unit only spreads load. So a unit below TARGET (2) live replicas must outbid *any* unit at or
  above it, whatever their demand: each missing replica multiplies the reward by SCARCITY (1e4),
  which is more than the largest demand ratio the cap allows ((FLOOR + DEMAND_CAP) / FLOOR =
  1001). The issue's quick model shows why: a naive ``demand / (coverage + 1)`` lets hot units
  hoard replicas (~57 % of units with >= 2 at 1,000 phones, worse than random placement's ~79 %).
* **Then demand.** Among units of the same scarcity tier, the hotter pays more, shared among its
  replicas (``/ (1 + r)``): load follows demand, and a hot unit's 5th replica is worth less than a
  lukewarm unit's 3rd.
* **FLOOR** (0.1): a unit nobody routes to yet still has a reward, so cold units get covered
  (demand records are decayed counts: "cold now" is not "never needed").
* **DEMAND_CAP** (100): the Zipf head of a real router is ~1,000 times the mean; uncapped, one
  expert block would absorb every spare byte of the swarm.
* **LACKS_WEIGHT** (4): a backbone with an expert cache (``--expert-cache``) flags in its demand
  record the units it does not hold locally (``lacks``). Its demand for such a unit counts
  LACKS_WEIGHT times (:func:`backbone_demand`): a backbone that holds a unit computes it itself
  when no worker does (a local fallback, at local speed), one that lacks it must fetch the
  unit's slabs from a peer first (megabytes, seconds) or fail the request when nobody holds them.
  So among units of one scarcity tier a lacked one outbids a held one of up to 4x its demand;
  the scarcity tiers themselves are unchanged (SCARCITY still dominates).

Pure functions on numpy arrays, no I/O: the node (``market/enrol.py``) and ``bench/market_sim.py``
call the same code.
"""
from __future__ import annotations

import numpy as np

TARGET = 2  # live replicas a unit should have before demand matters
SCARCITY = 1e4  # reward multiplier per replica missing below TARGET
FLOOR = 0.1  # demand floor (in units of the mean): cold units still pay
DEMAND_CAP = 100.0  # no unit counts as more than 100 average units
LACKS_WEIGHT = 4.0  # a backbone's demand for a unit it lacks locally counts this many times


def backbone_demand(demands, lacks=None) -> np.ndarray:
    """The summed demand of several backbones' records, per unit: ``demands[k][i]`` is backbone
    k's demand for unit i, ``lacks[k]`` its ``lacks`` flags (empty or None: it holds every unit);
    a lacked unit's demand counts :data:`LACKS_WEIGHT` times (see the module doc)."""
    rows = [np.asarray(d, dtype=np.float64) for d in demands]
    if not rows:
        return np.zeros(0)
    total = np.zeros_like(rows[0])
    for k, d in enumerate(rows):
        flags = lacks[k] if lacks is not None and k < len(lacks) else None
        if flags is not None and len(flags) == len(d):
            d = d * np.where(np.asarray(flags, dtype=bool), LACKS_WEIGHT, 1.0)
        total = total + d
    return total


def normalised_demand(demand: np.ndarray) -> np.ndarray:
    """Demand per unit divided by its mean (all ones when there is no demand at all)."""
    d = np.asarray(demand, dtype=np.float64)
    if d.size == 0:
        return d
    d = np.where(np.isfinite(d) & (d > 0), d, 0.0)
    mean = d.mean()
    return np.ones_like(d) if mean <= 0 else d / mean


def reward(demand: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """f(demand, replicas) per unit (see the module doc); ``replicas``: *other* live replicas."""
    d_hat = np.minimum(normalised_demand(demand), DEMAND_CAP)
    r = np.maximum(np.asarray(replicas, dtype=np.float64), 0.0)
    missing = np.maximum(0.0, TARGET - r)
    return SCARCITY ** missing * (FLOOR + d_hat) / (1.0 + r)
