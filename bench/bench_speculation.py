"""Speculative decoding behind a WAN: one sequence's tokens per step and tokens/s, speculation on
against off, alternating in one run.

Setup: a synthetic qwen35moe model (Gated DeltaNet + gated attention, ``--preset tiny``: 4 layers;
``--layers`` cuts it), 4 expert worker processes (``p2pswarm worker`` on local sockets), each
behind an emulated WAN link of ``--rtt`` ms (one ``python -m p2pswarm.net.wire.wanproxy`` process for
the four links), a backbone in this process that holds no expert it computes: every expert group
goes to a worker (checked: no local group, no fallback). One greedy sequence generates
``--tokens`` tokens, ``--rounds`` times per mode, the modes alternating (off, then each drafter,
then off again ...).

Drafters: ``ngram`` (the product's prompt lookup, on a prompt that repeats: what a random-weight
model's acceptance is, usually near 0) and, to measure the mechanism at known acceptance rates, a
*bench drafter* that drafts the sequence's own greedy continuation (from the off run) with each
draft token wrong with probability 1 - a (a = 0.5, 0.8, 0.95, seeded): the issue's "agreement knob"
without an MTP head (``--mtp-agreement``: with the model's own). Every run's tokens are checked equal to the off run's.

Reported per mode: tokens per step (a step is L round trips: tokens per round trip of each layer),
the acceptance (accepted / drafted), tokens/s, and the speed-up against off in the same round.
Goal of the issue: speed-up >= 0.9 x (1 + mean accepted drafts per step); at acceptance ~0 no worse
than 0.95x (it stops drafting).

    python bench/bench_speculation.py [--rtt 50] [--tokens 32] [--rounds 2] [--layers 2] [--draft-max 4]
        [--concurrent 64] [--preset tiny|geometry-122b] [--mtp-agreement A]
        [--mtp-arch glm4moe|qwen35moe|deepseek2] [--mtp-experts local|workers] [--scratch DIR] [--model PATH]
        [--out docs/benchmarks.md]

``--mtp-agreement A``: instead, a model (``--mtp-arch``: glm4moe, the default, qwen35moe or
deepseek2; ``--preset`` applies to qwen35moe) whose MTP block agrees with its trunk at knob A
(``make-model --mtp-agreement``), off against ``--speculate mtp`` with K and with K=1: the model's
own block drafts. Its experts (``--mtp-experts``): ``local`` (default), on the backbone's copy where
that is faster than a worker's round trip (the dispatcher's hot-expert rule for the block's layer:
behind 50 ms links, always), so a draft costs no round trip; ``workers``: the backbone holds no
expert (``--expert-cache none``), so every draft token costs one round trip to the block's owners.

``--concurrent N``: also N sequences at once, off against ngram (``--mtp-agreement``: mtp)
alternating (aggregate tokens/s; a step of more than 8 decoding sequences drafts nothing, so
this measures what asking costs).

``mtp (= auto)``: what ``--speculate auto`` runs on such a file, a backbone file included (the
draft length chosen each step from the measured costs: ``speculation.choose_lengths``); "drafted
per step" shows the lengths it chose.

Every row records the seconds per step, of which drafting (the MTP block, serial before the
step's layers), the CPU seconds per step of every process of the run (this one, the workers, the
WAN proxy: :func:`tree_cpu`, which the load moves much less than wall time) and of this one alone
(the backbone: which side an extra verified row costs on), and the 1-minute load
average at each of its runs (the machine is shared); the
end says how many layers of verification steps ran as one chunk and how many in rounds
(``Backbone.verify_calls``).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from common import header

from p2pswarm.backbone.owners.expert_cache import parse_cache_size
from p2pswarm.backbone.serving.scheduler import Params, Scheduler
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.backbone.serving.speculation import Speculation
from p2pswarm.model.synth import make_model

PROMPT = [5, 211, 37, 90, 14, 5, 211, 37, 90, 14, 5, 211, 37, 90, 14, 5, 211, 37]


def knob_drafter(wanted: list[int], rate: float, seed: int = 0):
    """Drafts ``wanted`` (the greedy continuation of PROMPT) from where the history is, each token
    wrong with probability 1 - ``rate`` (decided by its position: the same every run)."""
    def draft(history: list[int], k: int) -> list[int]:
        n = len(history) - len(PROMPT)
        out = []
        for j, t in enumerate(wanted[n:n + k]):
            ok = random.Random(seed * 1_000_003 + n + j).random() < rate
            out.append(t if ok else (t + 1) % 500)
        return out
    return draft


CPU_S = [0.0, 0.0]  # CPU seconds of the last _one: all processes (tree_cpu), this one (the backbone)
DRAFT_S = [0.0]  # seconds spent in the MTP block's drafting (serial before each step's layers)


def _timed_drafts() -> None:
    """Count the MTP block's drafting time (:data:`DRAFT_S`): at ``--layers 4`` the block is one
    of five blocks, at the 122B one of 49, so its share of a step is what a short model inflates."""
    from p2pswarm.backbone.serving.mtp import MtpBlock

    plain = MtpBlock.draft

    def draft(self, state, history, k):
        t0 = time.perf_counter()
        try:
            return plain(self, state, history, k)
        finally:
            DRAFT_S[0] += time.perf_counter() - t0

    MtpBlock.draft = draft  # type: ignore[method-assign]


def tree_cpu() -> float:
    """CPU seconds (user + system) so far of this process and every process below it (the workers,
    the WAN proxy), from /proc: a step's whole cost on this machine, whatever the load around it."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(rest[1])
        ticks[int(d)] = int(rest[11]) + int(rest[12])
    mine, total = {os.getpid()}, 0
    grew = True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in mine and pid not in mine:
                mine.add(pid)
                grew = True
    total = sum(ticks.get(pid, 0) for pid in mine)
    return total / tick


async def _one(bb, spec, tokens: int) -> tuple[list[int], float, int, object, float]:
    sched = Scheduler(bb, None, micro_batches=1, gather=(0, 0), speculate=spec)
    toks: list[int] = []
    d0 = DRAFT_S[0]
    c0, b0 = tree_cpu(), time.process_time()
    t0 = time.perf_counter()
    async with sched.submit(PROMPT, Params(max_tokens=tokens, stop_at_eos=False)) as req:
        async for item in sched.drive(req):
            toks.append(item.token)
    took = time.perf_counter() - t0
    CPU_S[0], CPU_S[1] = tree_cpu() - c0, time.process_time() - b0
    # (the prompt's step is not a decode step)
    return toks, took, sched.stats.steps - 1, sched.spec, DRAFT_S[0] - d0


async def _many(bb, spec, n: int, tokens: int) -> tuple[float, int, object]:
    """``n`` sequences at once (distinct prompts, greedy): wall seconds, tokens, the SpecStats."""
    sched = Scheduler(bb, None, speculate=spec)
    got = [0]

    async def one(req):
        async with req:
            async for _ in req:
                got[0] += 1

    reqs = [sched.submit([(7 * i + 3 * j) % 500 + 1 for j in range(8)] + PROMPT[:6],
                         Params(max_tokens=tokens, stop_at_eos=False)) for i in range(n)]
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as clients:
            for r in reqs:
                clients.start_soon(one, r)
            await nursery.start(sched.run)
        nursery.cancel_scope.cancel()
    return time.perf_counter() - t0, got[0], sched.spec


async def _bench(args, model: Path) -> list[str]:
    cache = parse_cache_size("none") if args.mtp_experts == "workers" else None
    async with open_backbone(model, workers=4, transport="socket", kernel=args.kernel, expert_cache=cache) as swarm:
        targets = [f"{o.host}:{o.port}" for o in swarm.owners]
        proxy = subprocess.Popen([sys.executable, "-m", "p2pswarm.net.wire.wanproxy", "--rtt-ms", str(args.rtt),
                                  *[a for t in targets for a in ("--target", t)]],
                                 stdout=subprocess.PIPE, text=True)
        try:
            line = proxy.stdout.readline().split()  # READY HOST:PORT ...
            assert line and line[0] == "READY", line
            for o, hp in zip(swarm.owners, line[1:]):  # before the first connection: through the links
                host, port = hp.rsplit(":", 1)
                o.host, o.port = host, int(port)
            bb = swarm.backbone
            before = bb.dispatcher.stats.snapshot()
            wanted = (await _one(bb, None, args.tokens))[0]  # warm-up, and the reference tokens
            modes = {"off": None, "ngram": Speculation("ngram", args.draft_max)}
            if args.mtp_agreement is not None:  # the model's MTP block drafts
                modes = {"off": None, "mtp (= auto)": Speculation("mtp", args.draft_max), "mtp, K=1": Speculation("mtp", 1)}
            else:
                for rate in (0.5, 0.8, 0.95):
                    modes[f"knob {rate}"] = Speculation("ngram", args.draft_max, drafter=knob_drafter(wanted, rate))
                modes["knob 0.8, K=1"] = Speculation("ngram", 1, drafter=knob_drafter(wanted, 0.8))
            # warm-up: the first verification runs the batch-invariance probes once (seconds at the
            # 122B's geometry; a served backbone pays them once too), not charged to a timed round
            await _one(bb, modes["mtp (= auto)" if args.mtp_agreement is not None else "knob 0.8"], 4)
            res: dict[str, list] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for name, spec in modes.items():
                    toks, took, steps, st, drafting = await _one(bb, spec, args.tokens)
                    assert toks == wanted, f"{name}: tokens differ from the run without speculation"
                    res[name].append((took, steps, st.accepted, st.drafted, os.getloadavg()[0], drafting, CPU_S[0], CPU_S[1]))
            on = "mtp (= auto)" if args.mtp_agreement is not None else "ngram"
            many: dict[str, list] = {"off": [], on: []}
            for _ in range(args.rounds if args.concurrent else 0):
                for name in many:
                    took, n_tok, st = await _many(bb, modes[name], args.concurrent, args.tokens)
                    many[name].append((took, n_tok, st.drafted, os.getloadavg()[0]))
            stats = bb.dispatcher.stats.since(before)
            # every trunk expert on a worker; the MTP block's where the dispatcher put them
            block = sum(s.mtp.bank.groups for s in modes.values() if s is not None and s.mtp is not None)
            assert stats.local_groups <= block and stats.fallbacks == 0, stats
            if args.mtp_experts == "workers":
                assert stats.local_groups == 0, stats
            paths = dict(bb.verify_calls)
        finally:
            proxy.terminate()
            proxy.wait(10)
    off_s = statistics.median(r[0] for r in res["off"])
    rows = ["| mode | acceptance | drafts accepted per step | tokens per step | tokens/s | speed-up vs off | "
            "goal 0.9 x (1 + accepted per step) | drafted per step | s per step: all / drafting | "
            "CPU s per step: all processes / the backbone | load (1 min) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in res.items():
        took = statistics.median(r[0] for r in runs)
        steps = sum(r[1] for r in runs)  # all rounds together (the same tokens each round)
        accepted, drafted = sum(r[2] for r in runs), sum(r[3] for r in runs)
        acc = f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "-"
        per_step = accepted / max(steps, 1)
        goal = f"{0.9 * (1 + per_step):.2f}" if drafted else "-"
        rows.append(f"| {name} | {acc} | {per_step:.2f} | {len(runs) * (args.tokens - 1) / max(steps, 1):.2f} | "
                    f"{args.tokens / took:.1f} | {off_s / took:.2f}x | {goal} | {drafted / max(steps, 1):.2f} | "
                    f"{sum(r[0] for r in runs) / max(steps, 1):.3f} / {sum(r[5] for r in runs) / max(steps, 1):.3f} | "
                    f"{sum(r[6] for r in runs) / max(steps, 1):.3f} / {sum(r[7] for r in runs) / max(steps, 1):.3f} | "
                    f"{'-'.join(f'{r[4]:.1f}' for r in runs)} |")
    if args.concurrent:
        rate = {m: statistics.median(n / t for t, n, _, _ in runs) for m, runs in many.items()}
        load = "-".join(f"{r[3]:.1f}" for runs in many.values() for r in runs)
        rows += ["", f"{args.concurrent} concurrent sequences, {args.tokens} tokens each (aggregate tokens/s, "
                     f"median of {args.rounds}): off {rate['off']:.1f}, {on} {rate[on]:.1f} "
                     f"({rate[on] / rate['off']:.2f}x; drafts {sum(r[2] for r in many[on])}; load {load})"]
    rows += ["", f"verification layers computed as one chunk: {paths['chunk']}, in rounds of one position: "
                 f"{paths['rounds']} (Backbone.verify_calls)"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt", type=float, default=50.0, help="emulated round trip per worker link, ms")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--preset", default="tiny", choices=("tiny", "geometry-122b"),
                    help="tiny (default) or geometry-122b: the 122B's layer geometry (2.8 GB at 2 layers, Q8_0, "
                         "written to a temporary folder and removed)")
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--kernel", default="ggml")
    ap.add_argument("--concurrent", type=int, default=0, metavar="N",
                    help="also N sequences at once, speculation off against ngram (aggregate tokens/s)")
    ap.add_argument("--mtp-agreement", type=float, default=None, metavar="A",
                    help="instead: a model whose MTP block agrees with its trunk at knob A "
                         "(make-model --mtp-agreement), off against --speculate mtp (K and K=1)")
    ap.add_argument("--mtp-arch", default="glm4moe", choices=("glm4moe", "qwen35moe", "deepseek2"),
                    help="the architecture of --mtp-agreement's model (glm4moe, deepseek2: tiny; qwen35moe: --preset)")
    ap.add_argument("--mtp-experts", default="local", choices=("local", "workers"),
                    help="the MTP block's experts: local (the backbone's copy where faster than a round trip) "
                         "or workers (the backbone holds no expert: --expert-cache none)")
    ap.add_argument("--out", help="append the table to this markdown file (docs/benchmarks.md)")
    ap.add_argument("--scratch", default=None, metavar="DIR",
                    help="where the model file is written (and removed after); default the system's temp folder")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="keep the model file here (made if absent, with these options; reused after: "
                         "a 7 GB write saved per run)")
    args = ap.parse_args()
    _timed_drafts()
    with tempfile.TemporaryDirectory(prefix="bench-spec-", dir=args.scratch) as d:
        model = Path(args.model) if args.model else Path(d) / "q35.gguf"
        if model.exists():
            pass  # --model made by an earlier run with the same options
        elif args.mtp_agreement is not None:
            make_model(model, arch=args.mtp_arch, preset=args.preset if args.mtp_arch == "qwen35moe" else "tiny",
                       layers=args.layers, qtype="q8_0", seed=46, mtp_agreement=args.mtp_agreement)
        else:
            make_model(model, arch="qwen35moe", preset=args.preset, layers=args.layers, qtype="q8_0", seed=43)
        rows = trio.run(_bench, args, model)
    text = "\n".join(rows)
    print(text)
    if args.out:
        cmd = " ".join(["python bench/bench_speculation.py", *sys.argv[1:]])
        with open(args.out, "a") as f:
            f.write("\n" + header(f"Speculative decoding behind {args.rtt:g} ms links", cmd) + "\n" + text + "\n")


if __name__ == "__main__":
    main()
