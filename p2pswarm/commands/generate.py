"""`p2pswarm generate MODEL.gguf --prompt "..." [--workers N]`: stream generated text."""
from __future__ import annotations

import sys

import trio

from p2pswarm.backbone.serving.generate import Rewind, generate
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.commands.common import (add_speculate_args, add_swarm_args, check_workers, open_model, require_full_model,
                                      speculation_from)
from p2pswarm.engine.text.tokenizer import Tokenizer
from p2pswarm.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text, greedy or sampled, monolithic or through workers")
    p.add_argument("model", help="the full model GGUF")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches P, in "
                        "(0, 1] (default %(default)s: all)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the sampler: the same seed gives the same text (default %(default)s)")
    p.add_argument("--stats", action="store_true", help="print per-step dispatch stats to stderr")
    add_speculate_args(p)
    add_swarm_args(p)
    p.set_defaults(func=run)


async def _run(args, speculate) -> None:
    tok = Tokenizer.from_gguf(args.model)
    ids = tok.encode(args.prompt)
    if not ids:
        raise UserError("the prompt tokenizes to nothing")
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    async with open_model(args) as swarm:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        n, secs, drafted, accepted = 0, 0.0, 0, 0
        pieces: list[str] = []
        async for step in generate(swarm.backbone, tok, ids, max_tokens=args.max_tokens, sampler=sampler,
                                   speculate=speculate):
            if isinstance(step, Rewind):  # replay on ban: what was printed cannot be taken back
                del pieces[step.keep:]
                print(f"\n[worker {step.worker} was banned for returning wrong numbers: tokens {step.keep}-"
                      f"{step.sent - 1} are withdrawn; the corrected text follows]", file=sys.stderr)
                sys.stdout.write("\n" + args.prompt + "".join(pieces))
                n = step.keep
                continue
            drafted, accepted = drafted + step.drafted, accepted + step.accepted
            pieces.append(step.text)
            sys.stdout.write(step.text)
            sys.stdout.flush()
            n += 1
            secs += step.seconds
            if args.stats:
                d = step.dispatch
                print(f"\n[step {step.index}: token {step.token}, {step.seconds * 1000:.1f} ms, "
                      f"{d.requests} requests, {d.remote_rows} remote rows, {d.fallbacks} fallbacks]",
                      file=sys.stderr)
        sys.stdout.write("\n")
        where = "through the swarm" if args.swarm else f"{args.workers} workers"
        spec = f"; {accepted} of {drafted} drafted tokens accepted" if speculate is not None else ""
        print(f"{n} tokens in {secs:.2f} s ({n / max(secs, 1e-9):.1f} tokens/s), {where}{spec}",
              file=sys.stderr)


def run(args) -> int:
    check_workers(args.workers)
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
    require_full_model(args.model)
    trio.run(_run, args, speculation_from(args, args.model))
    return 0
