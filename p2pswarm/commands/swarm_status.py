"""`p2pswarm swarm-status --bootstrap MULTIADDR --model M.gguf`: which units are covered, by how many.

Joins the DHT as a client with a throw-away identity, resolves every coverage unit of the model
(layers x expert blocks) through DHT look-ups, and prints a table of replica counts per layer and
block (`.` = nobody: the backbone's local replica computes it), then the owners.
"""
from __future__ import annotations

import json

import trio

from p2pswarm.engine import kernels

from p2pswarm.commands.common import KERNEL_CHOICES
from p2pswarm.net.records import DEFAULT_BLOCK_SIZE
from p2pswarm.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("swarm-status", help="coverage of a model's experts in the swarm")
    p.add_argument("--bootstrap", action="append", required=True, help="bootstrap peer multiaddr (repeatable)")
    p.add_argument("--model", required=True, help="the model GGUF (for its fingerprint and geometry)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default=None,
                   help="count workers whose kernel family matches this one on this machine (default auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


async def _status(args) -> dict:
    from p2pswarm.engine.kernels import kernel_id
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint
    from p2pswarm.net import expert_protocol as proto
    from p2pswarm.net.dht import CoverageResolver, open_dht
    from p2pswarm.net.host import open_host
    from p2pswarm.net.identity import Identity

    layout = ModelLayout.open(args.model)
    fp = model_fingerprint(layout)
    async with open_host(Identity.generate()) as net, open_dht(net, server=False, bootstrap=args.bootstrap) as dht:
        resolver = CoverageResolver(dht, model=fp, layers=layout.expert_layers, n_expert=layout.n_expert,
                                    block_size=args.block_size, protocol=proto.PROTOCOL_VERSION,
                                    kernel=kernel_id(args.kernel))
        cmap = await resolver.refresh()
    replicas = {(u.layer, u.block): n for u, n in cmap.replicas().items()}
    owners = {f"{o.peer}": {"addrs": list(o.addrs), "layers": list(o.shard.layers), "experts": list(o.shard.experts),
                            "kernel": o.record.kernel, "family": kernels.family(o.record.kernel)}
              for o in cmap.peers().values()}
    n_blocks = -(-layout.n_expert // args.block_size)
    return {"model": fp, "layers": layout.expert_layers, "blocks": n_blocks, "block_size": args.block_size,
            "replicas": {f"{layer}/{block}": n for (layer, block), n in sorted(replicas.items())},
            "missing": len(cmap.missing()), "units": len(replicas), "owners": owners}


def run(args) -> int:
    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    st = trio.run(_status, args)
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"model {st['model'][:12]}: {st['units']} units ({len(st['layers'])} layers x {st['blocks']} blocks of "
          f"{st['block_size']} experts), {st['missing']} with no worker")
    print("layer  replicas per block ('.' = none: computed by the backbone)")
    for layer in st["layers"]:
        cells = [st["replicas"].get(f"{layer}/{b}", 0) for b in range(st["blocks"])]
        print(f"{layer:>5}  " + " ".join("." if c == 0 else str(min(c, 9)) for c in cells))
    for peer, o in st["owners"].items():
        print(f"  {peer}: layers {o['layers'][0]}-{o['layers'][1] - 1}, experts {o['experts'][0]}-{o['experts'][1] - 1}"
              f" at {', '.join(o['addrs'])}, kernel {o['kernel']} (family {o['family']})")
    return 0
