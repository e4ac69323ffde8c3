"""`p2pswarm demo`: the whole M0+M1 story in one command, no arguments needed.

1. makes the tiny model if missing (with the real Qwen3.5 vocabulary, shipped with the package),
2. slices it into one shard per worker (each holds only its own experts),
3. starts the workers as separate OS processes on local sockets,
4. generates text through them, printing per-step dispatch stats,
5. checks the logits against the monolithic run (prefill and token-by-token decode) and prints
   the verdict; the exit code is non-zero if they differ.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

from p2pswarm import settings
from p2pswarm.backbone.serving.generate import Rewind, generate
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.sessions.local import cache_dir, open_backbone
from p2pswarm.commands.common import (add_kernel_args, add_speculate_args, line_buffered_stdout, require_full_model,
                                      speculation_from)
from p2pswarm.engine.text.tokenizer import Tokenizer
from p2pswarm.errors import UserError
from p2pswarm.backbone.serving.generate import sequence_logits

log = logging.getLogger("p2pswarm.demo")
DEFAULT_PROMPT = "A swarm of phones serves one large model:"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="make a tiny model, split it across worker processes, generate, check exactness")
    p.add_argument("--model", help="use this MoE GGUF instead of the built-in tiny model")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (default: %(default)r)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate, greedily (default %(default)s)")
    p.add_argument("--transport", choices=("socket", "inproc"), default="socket",
                   help="socket: each worker a separate OS process on a local socket (default); inproc: "
                        "workers as objects in this process (no sockets, for debugging)")
    p.add_argument("--swarm", action="store_true",
                   help="run the swarm instead: a bootstrap node and worker nodes as separate processes on "
                        "loopback, found by the backbone through the libp2p DHT")
    add_speculate_args(p)
    add_kernel_args(p)
    p.set_defaults(func=run)


def default_model() -> Path:
    """The demo's tiny model, made once and kept in the cache directory.

    It is a qwen35moe (Qwen3.5 MoE: Gated DeltaNet layers + a gated-attention layer, routed experts
    + a sigmoid-gated shared expert), the architecture of the seed's 122B model, so the first thing
    a newcomer runs is the real architecture, split across workers.
    """
    from p2pswarm.model.synth import make_model
    from p2pswarm.model.vocab import qwen35_vocab_path
    from p2pswarm.progress import ProgressBar

    d = cache_dir() / "demo"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "tiny-qwen35moe-qwen35vocab.gguf"
    if path.exists():
        return path
    vocab = qwen35_vocab_path()  # shipped with the package: nothing is downloaded
    print(f"making the tiny qwen35moe model (Qwen3.5 MoE: Gated DeltaNet + gated attention, the Qwen3.5 "
          f"vocabulary shipped in {vocab.name}) -> {path}")
    with ProgressBar("making the demo model", unit="B") as bar:
        make_model(path, arch="qwen35moe", preset="tiny", qtype="f32", vocab=vocab, seed=0, progress=bar)
    return path


@asynccontextmanager
async def _open_split(args, model: Path):
    """The split backbone the demo generates through, its workers described on stdout: local
    worker processes on sockets, or (--swarm) bootstrap + worker nodes found through the DHT."""
    if not args.swarm:
        async with open_backbone(model, workers=args.workers, transport=args.transport, kernel=args.kernel,
                                 threads=args.threads) as swarm:
            _describe(swarm.backbone, swarm.fingerprint)
            for wp, owner in zip(swarm.workers, swarm.owners):
                print(f"  {owner.name}: pid {wp.proc.pid} on {wp.host}:{wp.port}, experts "
                      f"{owner.experts[0]}-{owner.experts[1] - 1} of layers {owner.layers[0]}-{owner.layers[1] - 1}, "
                      f"shard {wp.shard.stat().st_size / 1e6:.1f} MB")
            yield swarm
        return
    from p2pswarm.backbone.sessions.local import ensure_shards, start_cli_process, stop_process
    from p2pswarm.backbone.sessions.swarm import open_swarm_backbone
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint

    layout = ModelLayout.open(model)
    shards = ensure_shards(layout, model_fingerprint(layout), args.workers)
    kernel = ["--kernel", args.kernel] if args.kernel else []
    procs = []
    with tempfile.TemporaryDirectory(prefix="p2pswarm-demo-") as keys:
        try:
            boot, boot_addr = await trio.to_thread.run_sync(start_cli_process, [
                "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", f"{keys}/boot.key"], "bootstrap node")
            procs.append(boot)
            print(f"bootstrap node: pid {boot.pid} at {boot_addr}")
            for i, shard in enumerate(shards):
                proc, addr = await trio.to_thread.run_sync(start_cli_process, [
                    "node", "--role", "worker", "--shard", str(shard), "--bootstrap", boot_addr,
                    "--identity", f"{keys}/w{i}.key", *kernel], f"worker node {i}")
                procs.append(proc)
                print(f"  worker node {i}: pid {proc.pid} at {addr}, shard {shard.name}")
            async with open_swarm_backbone(model, bootstrap=[boot_addr], kernel=args.kernel,
                                           threads=args.threads) as swarm:
                _describe(swarm.backbone, swarm.local.fingerprint)
                print(f"  backbone found {len(swarm.pool.owners)} owners through the DHT, "
                      f"{len(swarm.resolver.map.missing())} units uncovered")
                yield swarm
        finally:
            for proc in reversed(procs):
                stop_process(proc)


def _describe(backbone, fingerprint: str) -> None:
    m = backbone.model
    print(f"backbone: {m.arch}, {m.n_layer} layers, {m.n_expert} experts/layer (top-{m.n_expert_used}), "
          f"n_embd {m.n_embd}, vocab {m.n_vocab}; model fingerprint {fingerprint[:12]}")
    print(f"expert kernel: {backbone.dispatcher.local.bank.kernel}")


async def _demo(args) -> int:
    model = Path(args.model) if args.model else await trio.to_thread.run_sync(default_model)
    tok = Tokenizer.from_gguf(model)
    prompt_ids = tok.encode(args.prompt)
    print(f"model: {model}")
    print(f"prompt: {args.prompt!r} -> {len(prompt_ids)} tokens")
    speculate = speculation_from(args, model)

    async with _open_split(args, model) as swarm:
        print()
        print(f"{'step':>4} {'token':>7}  {'text':<16} {'requests':>8} {'rows':>5} {'dispatch ms':>11} {'step ms':>8}")
        generated: list[int] = []
        t0 = time.perf_counter()
        drafted = accepted = 0
        async for step in generate(swarm.backbone, tok, prompt_ids, max_tokens=args.max_tokens,
                                   sampler=Sampler(0.0), speculate=speculate):
            if isinstance(step, Rewind):  # a ban's replay: the demo's own workers are honest
                raise UserError(f"worker {step.worker} returned wrong numbers and was banned: the demo's workers "
                                "compute the model's own experts, so this machine computes differently from itself")
            drafted, accepted = drafted + step.drafted, accepted + step.accepted
            generated.append(step.token)
            d = step.dispatch
            print(f"{step.index:>4} {step.token:>7}  {step.text!r:<16.16} {d.requests:>8} {d.remote_rows:>5} "
                  f"{d.seconds * 1000:>11.1f} {step.seconds * 1000:>8.1f}")
        elapsed = time.perf_counter() - t0
        print(f"\ntext: {args.prompt}{tok.decode(generated)}")
        if speculate is not None:
            print(f"speculation ({speculate.mode}): {accepted} of {drafted} drafted tokens accepted")
        if not args.model:
            print("(the tiny model's weights are random, so its text is noise: what matters is where each\n"
                  " expert was computed, and that the result is exact)")
        where = f"{args.workers} worker nodes (libp2p)" if args.swarm else f"{args.workers} workers"
        print(f"{len(generated)} tokens in {elapsed:.2f} s through {where} "
              f"({swarm.backbone.dispatcher.stats.fallbacks} fallbacks)")
        seq = prompt_ids + generated[:-1] if len(generated) > 1 else prompt_ids
        split_prefill = await sequence_logits(swarm.backbone, seq)
        split_decode = await sequence_logits(swarm.backbone, seq, decode=True)

    async with open_backbone(model, workers=0, kernel=args.kernel, threads=args.threads) as mono:
        mono_prefill = await sequence_logits(mono.backbone, seq)
        mono_decode = await sequence_logits(mono.backbone, seq, decode=True)

    ok = True
    for what, a, b in (("prefill", split_prefill, mono_prefill), ("decode", split_decode, mono_decode)):
        same = np.array_equal(a, b)
        ok &= same
        print(f"exactness, {what:7}: split ({args.workers} workers) vs monolithic over {len(seq)} positions: "
              f"{'bit-identical' if same else 'DIFFERENT'} (max |diff| {float(np.max(np.abs(a - b))):.3g})")
    print("OK: the split run's logits equal the monolithic run's." if ok else "FAIL: logits differ.")
    return 0 if ok else 1


def run(args) -> int:
    if args.workers < 1:
        raise UserError("--workers must be >= 1 for the demo")
    if args.model:
        require_full_model(args.model)
    line_buffered_stdout()
    # The demo's own output is the story: routine INFO lines (ours, and the worker processes', which
    # inherit the variable) would drown its table. -v or P2PSWARM_LOG_LEVEL show them.
    if settings.LOG_LEVEL.name not in os.environ and not getattr(args, "verbose", False):
        os.environ[settings.LOG_LEVEL.name] = "WARNING"
        logging.getLogger("p2pswarm").setLevel(logging.WARNING)
    return trio.run(_demo, args)
