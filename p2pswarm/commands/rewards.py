"""`p2pswarm rewards [--dir D] [--json] [--bootstrap ADDR]`: a worker's contribution receipts, checked.

Reads every receipt under D (default ``$P2PSWARM_HOME/receipts``, where `node --role worker`
keeps them, one folder per worker peer id), verifies each signature, and checks each backbone's
chain: seqs contiguous from 1 and running totals equal to the sums of the periods. With
``--bootstrap``, it also looks up, in the DHT, a ban of the worker by each backbone it holds
receipts from: a ban voids that backbone's receipts from the seq it names on. A corrupt or forged
file is one line on stderr and exit 1; the rest are still listed.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pswarm.errors import UserError

if TYPE_CHECKING:  # imported when run: the command starts without libp2p
    from p2pswarm.market.bans import BanRecord


def add_parser(sub) -> None:
    from p2pswarm.market.receipts import default_receipts_dir

    p = sub.add_parser("rewards", help="list a worker's signed contribution receipts and check signatures and totals")
    p.add_argument("--dir", default=None, help=f"receipts folder (default {default_receipts_dir()}: every worker's)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of a table")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="also look up bans of the worker in the DHT through this peer (repeatable): banned "
                        "receipts are shown void")
    p.set_defaults(func=run)


async def _bans(bootstrap: list[str], pairs: list[tuple[str, str]]) -> dict[tuple[str, str], BanRecord]:
    from p2pswarm.market.bans import BanRecord, ban_key
    from p2pswarm.net.signed.envelope import SignedError
    from p2pswarm.market.swarm_dht import open_dht
    from p2pswarm.net.libp2p.host import open_host
    from p2pswarm.net.signed.identity import Identity

    found: dict[tuple[str, str], BanRecord] = {}
    async with open_host(Identity.generate()) as net, open_dht(net, server=False, bootstrap=bootstrap) as dht:
        async def one(worker: str, backbone: str) -> None:
            key = ban_key(worker, backbone)
            for v in await dht.get_values(key, timeout_s=10.0):
                try:
                    found[(worker, backbone)] = BanRecord.verify(v, key=key)
                    return
                except SignedError as exc:
                    print(f"ignored a ban record under {key}: {exc}", file=sys.stderr)

        async with trio.open_nursery() as nursery:
            for w, b in pairs:
                nursery.start_soon(one, w, b)
    return found


def run_started(epoch_ms: int) -> str:
    """A receipt chain's epoch (its backbone run's start, ms since 1970) as a UTC time to the second."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch_ms / 1000))
    except (OverflowError, OSError, ValueError):
        return str(epoch_ms)  # a signed but absurd epoch: shown as it is


def run(args) -> int:
    from p2pswarm.market.receipts import check_receipts, default_receipts_dir, load_receipts

    root = Path(args.dir) if args.dir else default_receipts_dir()
    if not root.is_dir():
        raise UserError(f"{root}: no such receipts folder (a worker keeps its receipts in "
                        f"{default_receipts_dir()}/<peer id>; pass --dir)")
    receipts, errors = load_receipts(root)
    chains = check_receipts(receipts)
    bans: dict[tuple[str, str], BanRecord] = {}
    if args.bootstrap and chains:
        bans = trio.run(_bans, args.bootstrap, sorted({(c.worker, c.backbone) for c in chains}))
    for c in chains:
        ban = bans.get((c.worker, c.backbone))
        if ban is not None and ban.voids_epoch <= c.epoch:
            c.voided_from = ban.voids_from_seq if ban.voids_epoch == c.epoch else 1
    for line in errors:
        print(line, file=sys.stderr)
    problems = [f"{c.worker[-12:]} from {c.backbone[-12:]} epoch {c.epoch}: {p}" for c in chains for p in c.problems]
    for line in problems:
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps({"dir": str(root), "chains": [c.to_json() for c in chains], "errors": errors,
                          "problems": problems, "ok": not errors and not problems}))
    else:
        # a chain is one run of a backbone (its epoch, in JSON: ms since 1970 at the run's start)
        print(f"{'worker':>14} {'backbone':>14} {'backbone run from (UTC)':>23} {'receipts':>8} {'rows':>10} "
              f"{'bytes':>12} status")
        for c in chains:
            status = "ok" if not c.problems else "BAD TOTALS"
            if c.voided_from is not None:
                status += f", void from seq {c.voided_from} (banned)"
            print(f"{c.worker[-14:]:>14} {c.backbone[-14:]:>14} {run_started(c.epoch):>23} {c.receipts:>8} "
                  f"{c.rows:>10} {c.bytes:>12} {status}")
        if not chains:
            print(f"no receipts under {root}")
    return 1 if errors or problems else 0
