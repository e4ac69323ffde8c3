"""A backbone that does not hold the model (issue 41): resident memory, disk and tokens/s with
``--expert-cache all / 10% / none``, and the hot-expert rule on vs off for one sequence.

    python bench/bench_expert_cache.py [--model M.gguf] [--rtt-ms 50] [--tokens 8] [--seqs 1,16] [--rounds 2]
                                       [--check-rate 0.01 | --no-checks]
    python bench/bench_expert_cache.py --dense-table      # the dense part of each architecture at real size

The swarm (bench/wan_swarm.py): a bootstrap node, 4 worker processes holding every expert twice
(experts [0, n/2) and [n/2, n) each on two workers), each behind a WAN proxy of ``--rtt-ms``,
and a backbone node; for 10% also a ``serve-shards`` seeder the backbone's cache fetches from
(signed manifest, node token). Configurations:

* ``all``  - the backbone on the full model (what a backbone was before the cache);
* ``10%``  - the backbone on the backbone file (`slice --backbone`), its cache filled from the
  seeder with the hottest 10% of the experts by measured demand (``--cache-refill 3``);
* ``none`` - the backbone file, no experts: the workers compute every one.

For each: the backbone's resident memory (VmRSS: its own pages and the model pages it mapped),
its disk (model file + the expert store's allocated blocks), tokens/s of 1 and 16 concurrent
greedy completions (the median of ``--rounds``, configurations alternated A B C A B C), the
cache's hit rate and its fetches (time per unit fetched). Then ``all`` with ``--hot-experts`` vs
``--no-hot-experts`` for one sequence, alternated on off on off.

Then one ``checks`` run: the backbone file with ``--expert-cache none`` and ``--verify-rate
--check-rate`` (0.01), a seeder to fetch from: every check fetches its unit's slabs, within the
default ``--verify-fetch-budget``; it prints the bytes per check and per generated token and the
share of picks checked. Each figure comes with the load average when it was taken, and each
configuration with the backbone's and the workers' RssAnon / RssFile (mapped model pages are
file pages the kernel may drop and read again).

Default model: deepseek2 ``geometry-671b`` with ``--layers 3`` (2 dense + 1 MoE layer at
DeepSeek-V3's per-layer sizes, Q8_0 dense, Q4_K experts) with all 256 routed experts
(``--n-expert`` fewer); made on first use.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan_swarm import Proc, WanSwarm

DEFAULT_MODEL = Path("/tmp/p2pswarm-bench/ds671-l3-e256.gguf")


# ---- the dense part of each architecture at its real size ------------------------------------------
#: (arch, preset, real layer count, vocabulary, where the numbers come from)
REAL = [
    ("qwen3moe", "geometry-122b", 48, None, "the 122B's expert geometry with qwen3moe attention, 48 layers"),
    ("qwen35moe", "geometry-122b", 48, None, "Qwen3.5-122B-A10B's geometry, 48 layers, every 2nd full attention as the preset lays them out"),
    ("gpt-oss", "geometry-gpt-oss-120b", 36, 201088, "gpt-oss-120b, 36 layers"),
    ("glm4moe", "geometry-glm45", 92, 151552, "GLM-4.5 355B, 92 layers (3 dense) + 1 NextN"),
    ("deepseek2", "geometry-671b", 61, 163840, "DeepSeek-V3/R1 671B, 61 layers (3 dense)"),
]


def _plans(arch: str, preset: str, layers: int, n_vocab: int | None, qtype: str):
    """The tensor plan make-model would write (no bytes written)."""
    from p2pswarm.model import synth
    from p2pswarm.model.synth_arches import PRESETS_BY_ARCH, resolve

    p = resolve(preset, layers, {}, PRESETS_BY_ARCH[arch]).refine(layers, {}, {})
    if n_vocab is None:
        n_vocab = synth._n_vocab(synth.vocab_tokenizer_kv(_qwen35_vocab()))
    return p.plan(n_vocab, qtype, p.expert_qtype, False, False), n_vocab


def _qwen35_vocab() -> str:
    from p2pswarm.model import vocab

    return str(vocab.qwen35_vocab_path())


def dense_table() -> str:
    """Markdown rows: each architecture's dense part (everything but the routed experts) and its
    routed experts, from the geometry presets' tensor plans at the real layer count, the dense
    tensors as Q8_0 and as Q4_K (4.5 bits a weight), the experts as the preset's type."""
    from p2pswarm.model.layout import EXPERT_TENSOR_RE

    rows = ["| architecture (model) | vocabulary | dense parameters | dense at Q8_0 | dense at Q4_K | routed experts "
            "(preset type) | dense share |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arch, preset, layers, n_vocab, what in REAL:
        plans, nv = _plans(arch, preset, layers, n_vocab, "q8_0")
        dense = [p for p in plans if not EXPERT_TENSOR_RE.match(p.name)]
        experts = sum(p.nbytes for p in plans if EXPERT_TENSOR_RE.match(p.name))
        params = sum(int(_prod(p.shape)) for p in dense)
        q8 = sum(p.nbytes for p in dense)
        big = sum(int(_prod(p.shape)) for p in dense if len(p.shape) >= 2)
        q8_mats = [p for p in dense if len(p.shape) >= 2 and getattr(p.gtype, "name", "") == "Q8_0"]
        q4 = q8 - sum(p.nbytes for p in q8_mats) + sum(int(_prod(p.shape)) * 9 // 16 for p in q8_mats)
        rows.append(f"| {arch} ({what}) | {nv:,} | {params / 1e9:.2f} B ({big / 1e9:.2f} B in matrices) | "
                    f"{q8 / 1e9:.1f} GB | {q4 / 1e9:.1f} GB | {experts / 1e9:.0f} GB | {q8 / (q8 + experts):.1%} |")
    return "\n".join(rows)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- the swarm run -------------------------------------------------------------------------------------
def _cli(*args: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"p2pswarm {args[0]} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def rss(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (or ``RssAnon``: private memory; ``RssFile``: mapped file pages, clean, which the
    kernel may drop and read again) of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_of(pid: int) -> dict:
    return {k: rss(pid, k) for k in ("VmRSS", "RssAnon", "RssFile")}


def _complete(base: str, prompt: str, max_tokens: int) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return int(json.load(r)["usage"]["completion_tokens"])


def tokens_per_s(base: str, seqs: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(seqs) as pool:
        n = sum(pool.map(lambda i: _complete(base, f"prompt number {i} of the bench", max_tokens), range(seqs)))
    return n / (time.perf_counter() - t0)


def run_config(name: str, model: Path, bfile: Path, work: Path, args, auth: dict) -> dict:
    n = args.n_expert
    ranges = [(0, n // 2), (n // 2, n), (0, n // 2), (n // 2, n)]
    fetching = ["--token", str(auth["token"]), "--trust-issuer", auth["issuer"]]
    extra = {"all": [], "10%": ["--expert-cache", "10%", *fetching, "--cache-refill", "3"],
             "none": ["--expert-cache", "none"],
             # verification at the default rate with no cache: every check fetches its unit's slabs
             "checks": ["--expert-cache", "none", *fetching, "--verify-rate", str(args.check_rate)],
             "hot-on": ["--hot-experts"], "hot-off": ["--no-hot-experts"]}[name]
    verify = [] if name == "checks" else ["--verify-rate", "0"]
    bb_model = model if name in ("all", "hot-on", "hot-off") else bfile
    d = work / "run"
    d.mkdir(exist_ok=True)
    out: dict = {"config": name}
    # a worker's deadline of 60 s, not 5: on a loaded 2-core machine a prefill of 32 experts can take
    # seconds, and a timed-out worker's fallback would measure the fallback, not the cache
    with WanSwarm(model, ranges=ranges, rtt_ms=args.rtt_ms, workdir=d, kernel="ggml", threads=1, timeout_s=60,
                  backbone_args=[*verify, *extra], backbone_model=bb_model) as sw:
        seeder = None
        try:
            if name in ("10%", "checks"):
                seeder = Proc(["serve-shards", "--model", str(model), "--manifest", str(auth["manifest"]),
                               "--trust-issuer", auth["issuer"], "--bootstrap", sw.boot.ready[0], "--identity",
                               str(work / "seed.key")], d / "seed.log", sw.env)
            sw.wait_covered(300)
            tokens_per_s(sw.base_url, 16 if name in ("10%",) else 1, args.tokens)  # warm-up (and demand)
            if name == "10%":  # the refill fetches the hottest 10% (every 3 s), then a second pass
                time.sleep(8)
                tokens_per_s(sw.base_url, 16, args.tokens)
                time.sleep(4)
            for s in args.seqs if not name.startswith("hot") else [1]:
                out[f"tok_s_{s}"] = tokens_per_s(sw.base_url, s, args.tokens)
                out[f"load_{s}"] = os.getloadavg()[0]
            out["rss"] = rss(sw.backbone.pid)
            out["mem"] = mem_of(sw.backbone.pid)
            out["workers_mem"] = [mem_of(w.pid) for w in sw.workers]
            st = sw.swarm()
            cache = st.get("expert_cache")
            out["cache"] = cache
            out["disk"] = os.path.getsize(bb_model) + ((cache or {}).get("disk_bytes") or 0)
            out["fallbacks"] = st["dispatch"]["fallbacks"]
            out["generated"] = sw.get("/health")["generated_tokens"]
        finally:
            if seeder is not None:
                seeder.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense-table", action="store_true", help="print the dense-part table and exit")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--n-expert", type=int, default=256, help="routed experts of the default model (made if missing)")
    ap.add_argument("--check-rate", type=float, default=0.01,
                    help="--verify-rate of the `checks` run (no cache: each check fetches its unit)")
    ap.add_argument("--no-checks", action="store_true", help="skip the `checks` run")
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    ap.add_argument("--seqs", default="1,16")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of all / 10%% / none")
    ap.add_argument("--hot-rounds", type=int, default=2, help="rounds of --hot-experts on / off")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/p2pswarm-bench/expert-cache"))
    args = ap.parse_args()
    if args.dense_table:
        print(dense_table())
        return 0
    args.seqs = [int(x) for x in args.seqs.split(",")]
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import source_fingerprint
    from p2pswarm.model.slicer import slice_backbone
    from p2pswarm.model.synth import make_model

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        make_model(model, arch="deepseek2", preset="geometry-671b", layers=3, n_expert=args.n_expert, qtype="q8_0")
    layout = ModelLayout.open(model)
    args.n_expert = layout.n_expert
    bfile = work / "backbone.gguf"
    if not bfile.exists():
        slice_backbone(model, bfile)
    env = dict(os.environ, P2PSWARM_HOME=str(work / "home"))
    fp = source_fingerprint(layout)
    auth = {"manifest": work / "m.manifest", "token": work / "bb.token"}
    auth["issuer"] = _cli("identity", "--path", str(work / "issuer.key"), env=env).split()[-1]
    (work / "run").mkdir(exist_ok=True)  # WanSwarm's backbone key: the token names its peer id
    bb_id = _cli("identity", "--path", str(work / "run" / "backbone.key"), env=env).split()[-1]
    if not auth["manifest"].exists():
        _cli("manifest", "--model", str(model), "--key", str(work / "issuer.key"), "--out", str(auth["manifest"]),
             env=env)
    _cli("token", "issue", "--key", str(work / "issuer.key"), "--peer", bb_id, "--allow", f"shard:{fp}",
         "--ttl", "4h", "--out", str(auth["token"]), "--force", env=env)
    experts = sum(layout.expert_bytes(layer) for layer in layout.expert_layers) * layout.n_expert
    load = os.getloadavg()
    print(f"model {model.name}: {layout.file_size / 1e9:.2f} GB, routed experts {experts / 1e9:.2f} GB, "
          f"backbone file {bfile.stat().st_size / 1e9:.2f} GB; {args.rtt_ms:.0f} ms RTT, 4 workers (every unit "
          f"twice), kernel ggml, 1 thread a node; load average {load[0]:.2f} at start on {os.cpu_count()} CPUs")
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name in ("all", "10%", "none"):
            r = run_config(name, model, bfile, work, args, auth)
            results.setdefault(name, []).append(r)
            print(json.dumps(r), flush=True)
    for _ in range(args.hot_rounds):
        for name in ("hot-on", "hot-off"):
            r = run_config(name, model, bfile, work, args, auth)
            results.setdefault(name, []).append(r)
            print(json.dumps(r), flush=True)

    if not args.no_checks:
        r = run_config("checks", model, bfile, work, args, auth)
        results["checks"] = [r]
        print(json.dumps(r), flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print("\n| --expert-cache | backbone RSS | backbone disk | tokens/s, 1 seq | tokens/s, 16 seqs | cache hit rate "
          "| fetched units (s each) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in [n for n in ("all", "10%", "none") if n in results]:
        c = results[name][-1]["cache"] or {}
        fetch = (f"{c['fetches']} ({c.get('fetch_seconds', 0) / c['fetches']:.3f} a unit of 3 slabs)"
                 if c.get("fetches") else "0")
        rate = c.get("hit_rate")
        print(f"| {name} | {med(name, 'rss') / 1e9:.2f} GB | {med(name, 'disk') / 1e9:.2f} GB | "
              f"{med(name, 'tok_s_1'):.2f} | {med(name, 'tok_s_16'):.2f} | "
              f"{'-' if rate is None else f'{rate:.1%}'} | {fetch} |")
    for name in [n for n in ("all", "10%", "none") if n in results]:
        for r in results[name]:
            wm = r["workers_mem"]
            print(f"{name}: backbone RSS {r['mem']['VmRSS'] / 1e9:.2f} GB (anon {r['mem']['RssAnon'] / 1e9:.2f}, file "
                  f"{r['mem']['RssFile'] / 1e9:.2f}); workers RSS {sum(m['VmRSS'] for m in wm) / 1e9:.2f} GB (anon "
                  f"{sum(m['RssAnon'] for m in wm) / 1e9:.2f}, file {sum(m['RssFile'] for m in wm) / 1e9:.2f}); "
                  f"load {r.get('load_1', 0):.1f} / {r.get('load_16', 0):.1f} at the 1- / 16-sequence figures")
    if "checks" in results:
        r = results["checks"][0]
        c = (r["cache"] or {}).get("check_fetches") or {}
        picks = c.get("picks_fetched", 0) + c.get("picks_refused", 0)
        print(f"\nchecks with no cache (--verify-rate {args.check_rate}, --verify-fetch-budget default "
              f"{c.get('bytes_per_period', 0) / 1e6:.0f} MB a minute): {r['generated']} tokens generated, "
              f"{picks} picks on uncached units, {c.get('picks_fetched', 0)} checked "
              f"({c.get('picks_fetched', 0) / max(1, picks):.1%}) on {c.get('checks', 0)} fetched units, "
              f"{c.get('fetched_bytes', 0) / 1e6:.1f} MB fetched "
              f"({c.get('fetched_bytes', 0) / max(1, c.get('checks', 0)) / 1e6:.1f} MB a check, "
              f"{c.get('fetched_bytes', 0) / max(1, r['generated']) / 1e6:.2f} MB a generated token), "
              f"{c.get('refused', 0)} units refused by the budget; tokens/s {r.get('tok_s_16', 0):.2f} at 16 seqs "
              f"(load {r.get('load_16', 0):.1f}); fallbacks {r['fallbacks']}")
    if "hot-on" not in results:
        return 0
    on, off = med("hot-on", "tok_s_1"), med("hot-off", "tok_s_1")
    print(f"\nall cached, one sequence: --hot-experts {on:.2f} tokens/s, --no-hot-experts {off:.2f} "
          f"(on/off {on / off:.2f}x); model {layout.file_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
