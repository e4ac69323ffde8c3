"""`p2pswarm logits MODEL.gguf --tokens 1,2,3 --out L.npy [--workers N] [--decode]`.

All-position logits as float32 [n_tokens, n_vocab]. ``--workers 0`` is the monolithic run; N > 0
splits the experts among N workers. ``--decode`` feeds the tokens one at a time through the KV
cache instead of one prefill. This is the command anyone uses to check exactness: run it twice and
compare the files.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import trio

from p2pswarm.commands.common import (add_swarm_args, check_workers, open_model, parse_ids, require_backbone_model,
                                     require_full_model)
from p2pswarm.errors import UserError
from p2pswarm.progress import ProgressBar
from p2pswarm.backbone.serving.generate import sequence_logits

log = logging.getLogger("p2pswarm.logits")


def add_parser(sub) -> None:
    p = sub.add_parser("logits", help="all-position logits of a token sequence, saved as .npy")
    p.add_argument("model", help="the full model GGUF")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .npy file (float32 [n_tokens, n_vocab])")
    p.add_argument("--decode", action="store_true", help="token by token through the KV cache")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (out, shape, decode, the dispatcher's counters: "
                        "requests, fallbacks, remote_groups, local_groups, per_owner, ...) instead of a sentence")
    add_swarm_args(p)
    p.set_defaults(func=run)


async def compute_logits(args, tokens):
    bar = ProgressBar("decode", unit="tokens")

    def on_step(done: int, total: int) -> None:
        log.debug("decode step %d/%d", done, total)
        bar.update(done, total)

    async with open_model(args) as swarm:
        try:
            logits = await sequence_logits(swarm.backbone, tokens, decode=args.decode, on_step=on_step)
        finally:
            bar.close()
        cache = swarm.backbone.dispatcher.cache
        return logits, swarm.backbone.dispatcher.stats, None if cache is None else cache.status()


def run(args) -> int:
    check_workers(args.workers)
    tokens = parse_ids(args.tokens)
    # through the swarm, the backbone file (`slice --backbone`) will do: the workers hold the experts
    (require_backbone_model if args.swarm else require_full_model)(args.model)
    out = Path(args.out)
    if not out.parent.exists():
        raise UserError(f"{out.parent}: output directory does not exist")
    logits, stats, cache = trio.run(compute_logits, args, tokens)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}.npy")
    np.save(tmp, logits.astype(np.float32, copy=False))
    os.replace(tmp, out)
    if args.json:  # for scripts and the tests: the numbers, not a sentence to parse
        print(json.dumps({"out": str(out), "shape": list(logits.shape), "decode": bool(args.decode),
                          **dataclasses.asdict(stats), **({"expert_cache": cache} if cache else {})}))
        return 0
    print(f"wrote {out}: logits {logits.shape[0]} x {logits.shape[1]} float32 "
          f"({'decode' if args.decode else 'prefill'}, {'swarm' if args.swarm else f'{args.workers} workers'}, "
          f"{stats.requests} expert requests, "
          f"{stats.fallbacks} fallbacks)")
    return 0
