"""`p2pswarm swarm-status --bootstrap MULTIADDR --model M.gguf`: who serves which experts, and who answers.

Joins the DHT as a client with a throw-away identity and resolves the model's coverage units
(layers x expert blocks) and its model key exactly as a backbone does. A live record only says its
worker signed it less than one TTL ago (60 s by default), so every provider whose record is live and
usable is then *probed*, concurrently, within ``--probe-timeout``: a libp2p dial, the expert
protocol's handshake with the backbone's own checks (protocol, model, kernel, shard hash, ranges)
and one echo. A worker killed a moment ago shows as unreachable at once, and drops out of the
look-ups when its record expires.

Replicas are counted per expert, among the workers that answered: a unit is covered as many times
as its least-covered expert (workers holding experts 0-5 and 6-10 cover the unit of experts 0-7
once, not twice). Workers the backbone cannot use (another kernel, block size, protocol or model)
are listed as ``refused: <reason>``, the same check and wording as the backbone's log, against the
kernel named by ``--kernel`` (by default the one this machine would run).

The coverage market (docs/market.md): the backbones' signed demand records for the model are read
too, and each unit's demand (summed over backbones, as a multiple of the mean unit's) and reward
(:func:`p2pswarm.market.reward.reward` at its live replica count: what a newly enrolling worker
would be offered) are shown beside its replicas.
"""
from __future__ import annotations

import json
import math
import time

import trio

from p2pswarm.engine.kernels import family
from p2pswarm.errors import UserError
from p2pswarm.net.signed.records import DEFAULT_BLOCK_SIZE

PROBE_TIMEOUT_S = 5.0
PROBE_CONCURRENCY = 32
GONE_SHOWN = 20  # the table lists this many gone peers (provider records linger 48 h); --json lists all


def add_parser(sub) -> None:
    p = sub.add_parser("swarm-status", help="coverage of a model's experts in the swarm, and which workers answer")
    p.add_argument("--bootstrap", action="append", required=True, help="bootstrap peer multiaddr (repeatable)")
    p.add_argument("--model", required=True, help="the model GGUF (for its fingerprint and geometry)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"experts per coverage unit, as the swarm's nodes use (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--kernel", default=None, metavar="auto|numpy|ggml|KERNEL_ID",
                   help="judge workers against this kernel: auto/numpy/ggml as on this machine (default auto), "
                        "or the exact kernel id a backbone logs, e.g. 'ggml-0.25.3-0c1e570/x86_64+sse3+...+llamafile'")
    p.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds to wait for each worker's dial, handshake and echo (default {PROBE_TIMEOUT_S:.0f})")
    p.add_argument("--no-probe", action="store_true",
                   help="trust the records alone: count every worker whose record is live (a killed worker "
                        "then still counts until its record expires)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def _kernel(name: str | None) -> str:
    from p2pswarm.engine.kernels import KERNELS, kernel_id

    if name is None or name.strip().lower() in KERNELS:
        return kernel_id(name)
    return name.strip()  # an exact kernel id, as a backbone elsewhere would put in its handshake


async def _probe_all(net, infos: dict, model: str, kernel: str, timeout_s: float) -> dict[str, tuple]:
    """(status, reason, rtt_s, families) of every (peer, shard) in ``infos``, probed concurrently;
    ``families``: the kernel families its hello said it answers in (empty unless live)."""
    from p2pswarm.backbone.owners.libp2p_owner import Libp2pOwner

    out: dict[str, tuple] = {}
    limiter = trio.CapacityLimiter(PROBE_CONCURRENCY)

    async def one(key: str, info) -> None:
        owner = Libp2pOwner(net, info, model_fingerprint=model, kernel=kernel, timeout_s=timeout_s, direct=False,
                            connect_timeout_s=timeout_s, name=info.peer)
        owner.on_refused = lambda _owner, _reason: None  # reported in the table, not logged
        async with limiter:
            out[key] = (*await owner.probe(), owner.families)

    async with trio.open_nursery() as nursery:
        for key, info in infos.items():
            nursery.start_soon(one, key, info)
    return out


def _shard(info, status: str, reason: str = "", rtt_s: float | None = None) -> dict:
    return {"shard": info.shard.shard, "layers": list(info.shard.layers), "experts": list(info.shard.experts),
            "status": status, "reason": reason, "rtt_ms": None if rtt_s is None else round(rtt_s * 1000, 1)}


def _record_times(rec, now: float) -> dict:
    return {"record_age_s": max(0, int(now - rec.issued)), "record_expires_in_s": int(rec.expires - now)}


async def _status(args) -> dict:
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.net.wire import expert_protocol as proto
    from p2pswarm.net.dht.coverage import NO_RECORD
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.dht.coverage import CoverageResolver
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity

    layout = ModelLayout.open(args.model)
    fp = model_fingerprint(layout)
    kernel = _kernel(args.kernel)
    async with open_host(Identity.generate()) as net, open_dht(net, server=False, bootstrap=args.bootstrap) as dht:
        resolver = CoverageResolver(dht, model=fp, layers=layout.expert_layers, n_expert=layout.n_expert,
                                    block_size=args.block_size, protocol=proto.PROTOCOL_VERSION, kernel=kernel)
        resolver.log_refusals = False
        cmap = await resolver.refresh()
        if cmap.missing() or NO_RECORD in resolver.gone.values():
            # Look once more before reporting a unit uncovered or a provider gone for want of its
            # record: a look-up right after a worker joined, or on a loaded host, can miss a
            # provider or a record the DHT does hold (one suite run showed a live worker as "gone:
            # no node record found"). The second pass re-reads every record found so far, the
            # providers' again, and looks the uncovered units up again.
            cmap = await resolver.refresh()
        infos = cmap.peers()
        probes = {} if args.no_probe else await _probe_all(net, infos, fp, kernel, args.probe_timeout)
        from p2pswarm.market.demand import find_demand

        demand_records = [r for r in await find_demand(dht) if r.model == fp]
    now = time.time()

    peers: dict[str, dict] = {}
    for key, info in infos.items():
        status, reason, rtt, answers = probes.get(key, ("unprobed", "", None, ()))
        p = peers.setdefault(info.peer, {"status": status, "reason": reason, "addrs": list(info.addrs),
                                         "kernel": info.record.kernel,
                                         "family": family(info.record.kernel), "answers_in": list(answers),
                                         "shards": [], **_record_times(info.record, now)})
        p["shards"].append(_shard(info, status, reason, rtt))
        if status != "live" and p["status"] == "live":  # a peer is as live as its least live shard
            p["status"], p["reason"] = status, reason
    for peer, (reason, rec) in sorted(resolver.refused.items()):
        peers[peer] = {"status": "refused", "reason": reason, "addrs": list(rec.addrs), "kernel": rec.kernel,
                       "family": family(rec.kernel),
                       "block_size": rec.block_size,
                       "shards": [{"shard": s.shard, "layers": list(s.layers), "experts": list(s.experts),
                                   "model": s.model} for s in rec.shards], **_record_times(rec, now)}
    for peer, reason in sorted(resolver.gone.items()):
        peers.setdefault(peer, {"status": "gone", "reason": reason, "addrs": [], "shards": []})

    usable = {k for k, (status, *_) in probes.items() if status == "live"} if probes else set(infos)
    replicas = cmap.replicas(alive=lambda o: f"{o.peer}/{o.shard.shard}" in usable)
    n_blocks = -(-layout.n_expert // args.block_size)
    counts: dict[str, int] = {}
    for p in peers.values():
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    market = _market(demand_records, replicas, layout.expert_layers, n_blocks, args.block_size)
    return {"model": fp, "kernel": kernel, "block_size": args.block_size, "layers": list(layout.expert_layers),
            "blocks": n_blocks, "units": len(replicas), "probed": not args.no_probe,
            "replicas": {f"{u.layer}/{u.block}": n for u, n in sorted(replicas.items())},
            "missing": sum(1 for n in replicas.values() if n == 0), "counts": counts, "peers": peers,
            "market": market}


def _market(records, replicas: dict, layers, n_blocks: int, block_size: int) -> dict:
    """Demand (multiple of the mean unit's; summed over backbones, a unit a backbone lacks weighted) and
    reward of every unit."""
    import numpy as np

    from p2pswarm.market.reward import backbone_demand, normalised_demand, reward

    keys = [(layer, b) for layer in layers for b in range(n_blocks)]
    usable = [r for r in records if r.block_size == block_size and tuple(r.layers) == tuple(layers)
              and r.n_blocks == n_blocks]
    # what workers' rewards follow: a unit's demand by a backbone lacking it counts LACKS_WEIGHT times
    demand = backbone_demand([r.demand for r in usable], [r.lacks for r in usable]) if usable else np.zeros(len(keys))
    by_unit = {(u.layer, u.block): n for u, n in replicas.items()}
    reps = np.array([by_unit.get(k, 0) for k in keys], dtype=np.float64)
    d_hat, w = normalised_demand(demand), reward(demand, reps)
    # backbones with an expert cache (--expert-cache) flag the units they cannot compute themselves
    lacking = [r for r in usable if r.lacks]
    lacked = np.sum([np.asarray(r.lacks, dtype=np.int64) for r in lacking], axis=0) if lacking else np.zeros(len(keys))
    return {"backbones": len(usable), "ignored": len(records) - len(usable), "cached_backbones": len(lacking),
            "units": {f"{layer}/{b}": {"demand": round(float(d_hat[i]), 3), "reward": float(w[i]),
                                       "lacked_by": int(lacked[i])}
                      for i, (layer, b) in enumerate(keys)}}


WIDTH = 120  # the table fits a 120-column terminal; --json has everything (addresses, reasons in full)
STATE_W, PEER_W, HOLDS_W, KERNEL_W, RTT_W = 11, 52, 20, 14, 7


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _holds(p: dict) -> str:
    s = p["shards"]
    if len(s) == 1:
        return f"L{s[0]['layers'][0]}-{s[0]['layers'][1] - 1} E{s[0]['experts'][0]}-{s[0]['experts'][1] - 1}"
    return f"{len(s)} shards" if s else "-"


def _peer_rows(peer: str, p: dict) -> list[str]:
    """A peer's row of the table; a second, indented line says why when it is not live."""
    rtts = [s["rtt_ms"] for s in p["shards"] if s.get("rtt_ms") is not None]
    state = {"unprobed": "listed"}.get(p["status"], p["status"])
    family = p.get("family") or ""
    answers = [a for a in p.get("answers_in") or () if a != family]
    kernel = family + (f" +{len(answers)}" if answers else "")
    expires = f"{p['record_expires_in_s']} s" if "record_expires_in_s" in p else "-"
    row = (f"{state:<{STATE_W}} {peer:<{PEER_W}} {_fit(_holds(p), HOLDS_W):<{HOLDS_W}} "
           f"{_fit(kernel or '-', KERNEL_W):<{KERNEL_W}} {(f'{max(rtts):.0f}' if rtts else '-'):>{RTT_W}} {expires:>8}")
    rows = [row.rstrip()]
    if p["status"] not in ("live", "unprobed"):
        rows.append(_fit(f"  {peer}: {p['status']}: {p['reason']}", WIDTH))
    return rows


def _grid(label: str, cells: list[str]) -> list[str]:
    """``label`` and its cells, wrapped at :data:`WIDTH` (a 122B layer has 32 blocks)."""
    lines, line = [], f"{label:>5} "
    for c in cells:
        if len(line) + 1 + len(c) > WIDTH:
            lines.append(line)
            line = " " * 6
        line += " " + c
    return [*lines, line]


def _print_table(st: dict) -> None:
    print(f"model {st['model']}")
    print(_fit(f"kernel {st['kernel']}", WIDTH))
    who = "live worker" if st["probed"] else "worker with a live record"
    print(f"{st['units']} units ({len(st['layers'])} layers x {st['blocks']} blocks of {st['block_size']} experts), "
          f"{st['missing']} with an expert no {who} serves")
    print(f"layer  replicas per block: its least-covered expert's {who}s ('.' = none: computed by the backbone)")
    for layer in st["layers"]:
        cells = [st["replicas"].get(f"{layer}/{b}", 0) for b in range(st["blocks"])]
        print("\n".join(_grid(str(layer), ["." if c == 0 else str(min(c, 9)) for c in cells])))
    m = st["market"]
    print(f"demand per block ({m['backbones']} backbone demand record(s); x the mean unit's; '-' = no record)"
          + (f"; {m['ignored']} of another block size ignored" if m["ignored"] else ""))
    for layer in st["layers"]:
        cells = [m["units"][f"{layer}/{b}"]["demand"] for b in range(st["blocks"])]
        print("\n".join(_grid(str(layer), ["-" if not m["backbones"] else f"{c:.1f}" for c in cells])))
    if m.get("cached_backbones"):
        lacked = [k for k, u in m["units"].items() if u["lacked_by"]]
        no_replica = [k for k in lacked if not st["replicas"].get(k, 0)]
        print(f"expert caches: {m['cached_backbones']} backbone(s) hold part of the experts; {len(lacked)} unit(s) "
              f"some backbone lacks, {len(no_replica)} of them with no live replica"
              + (f" ({', '.join(no_replica[:8])}{' ...' if len(no_replica) > 8 else ''})" if no_replica else ""))
    print("reward per block (log10 of f(demand, live replicas): 8+ = uncovered, 4+ = one replica; docs/market.md)")
    for layer in st["layers"]:
        cells = [m["units"][f"{layer}/{b}"]["reward"] for b in range(st["blocks"])]
        print("\n".join(_grid(str(layer), [f"{math.log10(c):.1f}" for c in cells])))
    order = ("live", "unprobed", "unreachable", "refused", "gone")
    c = st["counts"]
    shards = sum(len(p["shards"]) for p in st["peers"].values() if p["status"] in ("live", "unprobed"))
    print(f"workers: {sum(c.values())} peers ("
          + ", ".join(f"{c.get(s, 0)} {'listed' if s == 'unprobed' else s}" for s in order
                      if c.get(s) or s in ("live", "refused"))
          + f"), serving {shards} shards; --json for addresses and full reasons")
    print(f"{'state':<{STATE_W}} {'peer':<{PEER_W}} {'holds':<{HOLDS_W}} {'kernel family':<{KERNEL_W}} "
          f"{'rtt ms':>{RTT_W}} {'expires':>8}")
    gone_shown = 0
    for status in order:
        for peer, p in st["peers"].items():
            if p["status"] != status:
                continue
            if status == "gone":
                gone_shown += 1
                if gone_shown > GONE_SHOWN:
                    continue
            print("\n".join(_peer_rows(peer, p)))
    if gone_shown > GONE_SHOWN:
        print(f"  ... and {gone_shown - GONE_SHOWN} more gone (--json lists them all)")


def run(args) -> int:
    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    if not args.probe_timeout > 0:
        raise UserError("--probe-timeout must be > 0 seconds")
    st = trio.run(_status, args)
    if args.json:
        print(json.dumps(st))
        return 0
    _print_table(st)
    return 0
