"""The backbone engine against llama.cpp on the same file: decode, prefill, 16 sequences, CPU, RSS.

    python bench/bench_vs_llama.py [--arch qwen35moe|gpt-oss|deepseek2] [--layers 2] [--threads 2] [--rounds 3]
                                   [--type q8_0|q4_k_m] [--decode 16] [--prefill 128] [--last-row] [--seqs 16]
                                   [--batch-steps 4]
                                   [--llama-bufts inplace|default|both] [--llama-passive]
                                   [--ours-tree SRC] [--model M.gguf] [--write]

The model is geometry-122b qwen35moe (``p2pswarm make-model --preset geometry-122b --arch qwen35moe
--layers N --type q8_0 --vocab ggml-vocab-qwen35.gguf``: the 122B's layer geometry, Q4_K experts,
the real 151,936-token Qwen3.5 vocabulary), made once under ``--dir``; it is read through before
every run so the page cache holds it. Each side runs in its own OS process (a crash is a failed round, not a dead
benchmark; peak RSS is that process's VmHWM), the sides alternating A B A B for ``--rounds``
rounds; the table shows medians and ours / llama.cpp ratios. ``--arch gpt-oss`` makes
``geometry-gpt-oss-120b`` instead (gpt-oss-120b's layer geometry: MXFP4 experts, 64 heads of 64,
sliding window 128 on even layers; the built-in 540-token vocabulary, so the lm head is small).

Each process measures, with the same thread count and the same token ids:

* decode: a fresh sequence, an 8-token prompt, then ``--decode`` tokens one at a time (tokens/s,
  process CPU seconds per token);
* prefill: ``--prefill`` tokens of a fresh sequence in one call, logits for every position on both
  sides (``Backbone.forward`` returns all of them; llama.cpp is asked for all of them too, so both
  do the same work), after one untimed prefill of the same length (other tokens) on each side: a
  serving process's steady state, whose scratch memory a prefill of this size has already paged
  in (llama.cpp reserves its compute buffer at context creation; ours keeps a call's scratch,
  ``GgmlRunner``). ``--cold-prefill`` times the first one instead; ``--last-row`` asks both sides
  for the last row's logits only (a server's prefill: llama.cpp then runs its last layer's FFN on
  that row alone, ours ``forward_batch(last_only=True)`` its experts' groups that hold it);
* batch: ``--seqs`` sequences (a 4-token prompt each), then ``--batch-steps`` steps in which every
  sequence decodes one token: llama.cpp as one ``llama_decode`` of ``--seqs`` tokens (one per
  sequence), ours as ``--seqs`` concurrent ``Backbone.forward`` calls (each sequence on its own);
  tokens/s counts all sequences' tokens;
* batched rows (ours only, compared with llama.cpp's batch): the same steps as one
  ``Backbone.forward_batch`` of every sequence's row (what the scheduler behind the HTTP API runs:
  one ``layer_in`` and one expert-bank call per layer, in the default batch-invariant mode).

llama.cpp runs through llama-cpp-python's low-level API: F32 KV cache, flash attention off, and by
default ``use_extra_bufts = False`` (weights used in place: the kernels our engine calls). On CPUs
with AMX llama.cpp's default extra buffer types (repacked weights) crash in ``llama_decode``;
``--llama-bufts both`` also runs that default and reports it (or its crash) as a separate column.
``--llama-passive`` adds llama.cpp with ``OMP_WAIT_POLICY=PASSIVE``, the OpenMP wait policy
p2pswarm's engine sets for itself (see docs/kernels.md): the like-for-like comparison.
``--ours-tree`` adds p2pswarm from another source tree (e.g. the main branch) for before/after.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, header, llama_model, publish, warm_page_cache

DEFAULT_VOCAB = Path("/work/shared/vocab/ggml-vocab-qwen35.gguf")
PROMPT = 8
METRICS = ("decode_tps", "decode_cpu", "prefill_tps", "prefill_cpu", "batch_tps", "batch_cpu", "batchx_tps",
           "batchx_cpu", "rss_mb")


PRESET = {"qwen35moe": "geometry-122b", "gpt-oss": "geometry-gpt-oss-120b",  # --arch: the model made
          "deepseek2": "geometry-671b"}
VOCAB = [150_000]  # set by each side from its model (Qwen3.5's special tokens start above 150,000)


def tokens(n: int, salt: int = 0) -> list[int]:
    """Deterministic ids spread over the vocabulary, the same on both sides."""
    return [(7919 * i + 104729 * salt + 11) % VOCAB[0] for i in range(n)]


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Clock:
    """Wall and process-CPU seconds between start() and stop()."""

    def start(self):
        self.w, self.c = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.w, time.process_time() - self.c


# ---- one side per process -------------------------------------------------------------------------
def child_ours(a) -> dict:
    import trio

    sys.path.insert(0, os.environ.get("BENCH_OURS_TREE", str(REPO)))  # before common.py's REPO

    from p2pswarm.backbone.sessions.local import open_backbone

    async def run() -> dict:
        out, clk = {}, Clock()
        async with open_backbone(a.model, workers=0, kernel="ggml", threads=a.threads) as swarm:
            b = swarm.backbone
            VOCAB[0] = min(VOCAB[0], b.model.n_vocab)
            warm = b.new_state()
            await b.forward(tokens(PROMPT, 9), warm)
            await b.forward(tokens(1, 9), warm)
            del warm
            st = b.new_state()
            await b.forward(tokens(PROMPT), st)
            dec = tokens(a.decode, 1)
            clk.start()
            for t in dec:
                await b.forward([t], st)
            w, c = clk.stop()
            out["decode_tps"], out["decode_cpu"] = a.decode / w, c / a.decode
            del st
            if not a.cold_prefill:
                await b.forward_batch([(tokens(a.prefill, 3), b.new_state())], last_only=a.last_row)
            st = b.new_state()
            clk.start()
            await b.forward_batch([(tokens(a.prefill, 2), st)], last_only=a.last_row)
            w, c = clk.stop()
            out["prefill_tps"], out["prefill_cpu"] = a.prefill / w, c / a.prefill
            del st
            states = [b.new_state() for _ in range(a.seqs)]
            for i, s in enumerate(states):
                await b.forward(tokens(4, 10 + i), s)
            steps = [tokens(a.seqs, 100 + j) for j in range(a.batch_steps)]
            clk.start()
            for step in steps:
                async with trio.open_nursery() as n:
                    for s, t in zip(states, step):
                        n.start_soon(b.forward, [t], s)
            w, c = clk.stop()
            n_tok = a.seqs * a.batch_steps
            out["batch_tps"], out["batch_cpu"] = n_tok / w, c / n_tok
            if hasattr(b, "forward_batch"):  # every sequence's row in one step, as the scheduler drives it
                # warm-up: the first batched step runs the one-time row-invariance probes
                await b.forward_batch([(tokens(2, 50 + i), b.new_state()) for i in range(2)], last_only=True)
                states = [b.new_state() for _ in range(a.seqs)]
                for i, s in enumerate(states):
                    await b.forward(tokens(4, 10 + i), s)
                clk.start()
                for step in steps:
                    await b.forward_batch([([t], s) for s, t in zip(states, step)], last_only=True)
                w, c = clk.stop()
                out["batchx_tps"], out["batchx_cpu"] = n_tok / w, c / n_tok
        out["rss_mb"] = vm_hwm_mb()
        return out

    return trio.run(run)


def child_llama(a, extra_bufts: bool) -> dict:
    L, model, n_vocab = llama_model(a.model, extra_bufts)
    VOCAB[0] = min(VOCAB[0], n_vocab)
    n_ctx = max(512, a.prefill + PROMPT + a.decode + 64)

    def context(n_seq: int):
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx  # unified KV: the sequences share it
        cp.n_batch = cp.n_ubatch = max(a.prefill, a.seqs * 4, 64)
        cp.n_seq_max = n_seq
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = a.threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("llama.cpp could not create a context")
        return ctx

    batch = L.llama_batch_init(max(a.prefill, a.seqs * 4, 64), 0, max(a.seqs, 1))

    def decode(ctx, items, all_logits=False):
        """items: [(token, pos, seq)]; logits for the last item of each sequence (or every item)."""
        batch.n_tokens = len(items)
        last = {seq: i for i, (_, _, seq) in enumerate(items)}
        for i, (tok, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if all_logits or last[seq] == i else 0
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
        L.llama_synchronize(ctx)

    out, clk = {}, Clock()
    ctx = context(1)
    mem = L.llama_get_memory(ctx)
    decode(ctx, [(t, i, 0) for i, t in enumerate(tokens(PROMPT, 9))])  # warm
    L.llama_memory_clear(mem, True)
    decode(ctx, [(t, i, 0) for i, t in enumerate(tokens(PROMPT))])
    clk.start()
    for i, t in enumerate(tokens(a.decode, 1)):
        decode(ctx, [(t, PROMPT + i, 0)])
    w, c = clk.stop()
    out["decode_tps"], out["decode_cpu"] = a.decode / w, c / a.decode
    L.llama_memory_clear(mem, True)
    if not a.cold_prefill:
        decode(ctx, [(t, i, 0) for i, t in enumerate(tokens(a.prefill, 3))], all_logits=not a.last_row)
        L.llama_memory_clear(mem, True)
    clk.start()
    decode(ctx, [(t, i, 0) for i, t in enumerate(tokens(a.prefill, 2))], all_logits=not a.last_row)
    w, c = clk.stop()
    out["prefill_tps"], out["prefill_cpu"] = a.prefill / w, c / a.prefill
    L.llama_free(ctx)

    ctx = context(a.seqs)
    decode(ctx, [(t, i, s) for s in range(a.seqs) for i, t in enumerate(tokens(4, 10 + s))])
    clk.start()
    for j in range(a.batch_steps):
        decode(ctx, [(t, 4 + j, s) for s, t in enumerate(tokens(a.seqs, 100 + j))])
    w, c = clk.stop()
    n_tok = a.seqs * a.batch_steps
    out["batch_tps"], out["batch_cpu"] = n_tok / w, c / n_tok
    L.llama_free(ctx)
    L.llama_batch_free(batch)
    L.llama_model_free(model)
    out["rss_mb"] = vm_hwm_mb()
    return out


# ---- the driver -------------------------------------------------------------------------------------
def run_side(a, side: str) -> dict | str:
    """One side in a fresh process; its metrics, or a one-line reason it failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--model", str(a.model),
           "--threads", str(a.threads), "--decode", str(a.decode), "--prefill", str(a.prefill),
           "--seqs", str(a.seqs), "--batch-steps", str(a.batch_steps)] + (["--cold-prefill"] if a.cold_prefill else [])
    cmd += ["--last-row"] if a.last_row else []
    tree = a.ours_tree if side == "ours-tree" else REPO
    if side in ("ours-tree", "llama-passive", "ours-spinning"):
        cmd[cmd.index(side)] = "llama" if side == "llama-passive" else "ours"
    env = dict(os.environ, PYTHONPATH=str(tree), BENCH_OURS_TREE=str(tree), P2PSWARM_THREADS=str(a.threads))
    if side == "llama-passive":  # the OpenMP wait policy our engine sets for itself
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if side == "ours-spinning":  # llama.cpp's default policy, which ours keeps when the user set one
        env["OMP_WAIT_POLICY"] = "ACTIVE"
    warm_page_cache(a.model)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {a.timeout} s"
    if p.returncode != 0:
        why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        tail = (p.stderr.strip().splitlines() or [""])[-1][:160]
        return f"{why}: {tail}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def make_model(a) -> Path:
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    preset = PRESET[a.arch]
    qtype = a.type
    path = d / f"{preset}-{a.arch}-{a.layers}l-{qtype}.gguf"
    if not path.exists():
        cmd = [sys.executable, "-m", "p2pswarm.cli", "make-model", "-o", str(path), "--preset", preset,
               "--arch", a.arch, "--layers", str(a.layers), "--type", qtype, "-q"]
        if a.vocab and a.arch == "qwen35moe":
            cmd += ["--vocab", str(a.vocab)]
        subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return path


def fmt(v: float, metric: str) -> str:
    if math.isnan(v):
        return "n/a"
    if metric == "rss_mb":
        return f"{v:.0f}"
    if metric.endswith("_cpu"):
        return f"{v:.3f}"
    return f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=tuple(PRESET), default="qwen35moe",
                    help="the model made: geometry-122b qwen35moe (default), geometry-gpt-oss-120b gpt-oss or "
                         "geometry-671b deepseek2 (DeepSeek-V3's layer geometry)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the model made (2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--type", choices=("q8_0", "q4_k_m", "f16", "f32"),
                    help="dense tensors (q8_0; deepseek2: q4_k_m, by llama.cpp's quantiser); the experts are "
                         "Q4_K (qwen35moe, deepseek2) or MXFP4 (gpt-oss) whatever this says")
    ap.add_argument("--decode", type=int, default=16, help="decode steps of the single sequence (16)")
    ap.add_argument("--prefill", type=int, default=128, help="prefill length (128)")
    ap.add_argument("--seqs", type=int, default=16, help="sequences decoding together (16)")
    ap.add_argument("--batch-steps", type=int, default=4, help="steps of the sequences decoding together (4)")
    ap.add_argument("--llama-bufts", choices=("inplace", "default", "both"), default="inplace",
                    help="llama.cpp weights in place (use_extra_bufts=False, default), its default "
                         "extra buffer types, or both")
    ap.add_argument("--model", type=Path, help="use this GGUF instead of making one")
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "p2pswarm" / "bench"))
    ap.add_argument("--vocab", type=Path, default=DEFAULT_VOCAB if DEFAULT_VOCAB.exists() else None)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--label", default="", help="a note for the table title (e.g. 'before')")
    ap.add_argument("--llama-passive", action="store_true",
                    help="also run llama.cpp (in place) with OMP_WAIT_POLICY=PASSIVE, the policy p2pswarm sets")
    ap.add_argument("--ours-spinning", action="store_true",
                    help="also run p2pswarm with OMP_WAIT_POLICY=ACTIVE, llama.cpp's default (threads spin)")
    ap.add_argument("--ours-tree", type=Path,
                    help="also run p2pswarm from this source tree (e.g. the main branch: before/after)")
    ap.add_argument("--cold-prefill", action="store_true",
                    help="time each side's first prefill of this length (no untimed one before it)")
    ap.add_argument("--last-row", action="store_true",
                    help="the prefill's logits for its last row only, both sides (llama.cpp then computes "
                         "the last layer's FFN for that row alone; ours its experts' groups that hold it)")
    ap.add_argument("--child", choices=("ours", "llama", "llama-default"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.type = a.type or ("q4_k_m" if a.arch == "deepseek2" else "q8_0")
    if a.child:
        res = child_ours(a) if a.child == "ours" else child_llama(a, extra_bufts=a.child == "llama-default")
        print(json.dumps(res))
        return
    model_given = a.model is not None
    a.model = a.model or make_model(a)
    sides = (["ours-tree"] if a.ours_tree else []) + ["ours", "llama"]
    sides += ["llama-default"] if a.llama_bufts == "both" else []
    sides += ["llama-passive"] if a.llama_passive else []
    sides += ["ours-spinning"] if a.ours_spinning else []
    if a.llama_bufts == "default":
        sides[sides.index("llama")] = "llama-default"
    results: dict[str, list] = {s: [] for s in sides}
    for r in range(a.rounds):
        for s in sides:  # A B A B ...
            res = run_side(a, s)
            results[s].append(res)
            print(f"round {r + 1} {s}: {res}", file=sys.stderr, flush=True)
    med = {}
    for s in sides:
        ok = [x for x in results[s] if isinstance(x, dict)]
        med[s] = {m: statistics.median(x.get(m, math.nan) for x in ok) for m in METRICS} if ok else None
    base = "llama" if "llama" in sides else "llama-default"
    names = {"ours": "p2pswarm", "ours-tree": f"p2pswarm ({a.ours_tree})", "llama": "llama.cpp (in place)",
             "llama-default": "llama.cpp (default bufts)", "llama-passive": "llama.cpp (in place, OMP passive)",
             "ours-spinning": "p2pswarm (OMP spinning)"}
    cmd = ("python bench/bench_vs_llama.py " + (f"--model {a.model} " if model_given else "")
           + f"--arch {a.arch} --layers {a.layers} --threads {a.threads} --rounds {a.rounds} "
           f"--type {a.type} --llama-bufts {a.llama_bufts} --decode {a.decode} --prefill {a.prefill} "
           f"--seqs {a.seqs} --batch-steps {a.batch_steps}" + (" --llama-passive" if a.llama_passive else "")
           + (" --ours-spinning" if a.ours_spinning else "") + (f" --ours-tree {a.ours_tree}" if a.ours_tree else "")
           + (" --cold-prefill" if a.cold_prefill else "") + (" --last-row" if a.last_row else ""))
    what = f"`{Path(a.model).name}`" if model_given else f"{PRESET[a.arch]} {a.arch} {a.layers} layers"
    text = header(f"Backbone engine vs llama.cpp, {what}"
                  + (f" ({a.label})" if a.label else ""), cmd)
    which_logits = "the last row's logits only" if a.last_row else "all-position logits"
    text += (f"`{Path(a.model).name}` ({Path(a.model).stat().st_size / 2**30:.2f} GiB), {a.threads} threads both "
             f"sides, {a.rounds} rounds alternating, medians. decode: {a.decode} steps after an {PROMPT}-token "
             f"prompt; prefill: {a.prefill} tokens, {which_logits}, "
             f"{'the first of its length' if a.cold_prefill else 'after an untimed one of the same length'}; batch: {a.seqs} sequences x "
             f"{a.batch_steps} steps. CPU = process CPU seconds per token. llama.cpp: llama-cpp-python "
             "low-level API, F32 KV, flash attention off.\n\n")
    cols = ["decode tok/s", "decode CPU s/tok", "prefill tok/s", "prefill CPU s/tok",
            f"{a.seqs} seqs tok/s", f"{a.seqs} seqs CPU s/tok", f"{a.seqs} seqs batched rows tok/s",
            f"{a.seqs} seqs batched rows CPU s/tok", "peak RSS MB"]
    text += "| side | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    for s in sides:
        fails = [x for x in results[s] if not isinstance(x, dict)]
        if med[s] is None:
            text += f"| {names[s]} | failed every round: {fails[0]} |" + " |" * (len(cols) - 1) + "\n"
            continue
        text += f"| {names[s]} | " + " | ".join(fmt(med[s][m], m) for m in METRICS) + " |"
        text += (f" ({len(fails)} of {a.rounds} rounds failed: {fails[0]})\n" if fails else "\n")
    bases = [base] + (["llama-passive"] if med.get("llama-passive") else [])
    for s, bs in [(s, bs) for bs in bases for s in ("ours-tree", "ours", "ours-spinning")]:
        if med.get(s) and med.get(bs):
            o, b, base = med[s], med[bs], bs
            ref = {**b, "batchx_tps": b["batch_tps"], "batchx_cpu": b["batch_cpu"]}  # llama: one batch
            text += (f"| {names[s]} / {names[base]} | "
                     + " | ".join("n/a" if math.isnan(o[m]) else f"{o[m] / ref[m]:.2f}x" for m in METRICS) + " |\n")
    for s in ("ours-tree", "ours"):
        paired = paired_ratios(results.get(s, []), results.get(base, []))
        if paired:
            text += (f"| {names[s]} / {names[base]}, median of the rounds' own ratios | "
                     + " | ".join(paired.get(m, "n/a") for m in METRICS) + " |\n")
    publish(text, a.write)


def paired_ratios(ours: list, theirs: list) -> dict[str, str]:
    """Per metric, the median over rounds of ours / theirs within the same round, with its range.

    Why besides the ratio of medians: the two sides of a round run minutes apart at most, so a
    slow spell of this shared machine (other tenants) hits both, and their ratio cancels it; the
    median of those ratios is the steadier number when whole rounds move by 20%."""
    pairs = [(o, t) for o, t in zip(ours, theirs) if isinstance(o, dict) and isinstance(t, dict)]
    out = {}
    for m in METRICS:
        tm = "batch_" + m.split("_")[1] if m.startswith("batchx") else m  # llama: one batch
        rs = [o[m] / t[tm] for o, t in pairs if m in o and tm in t and t[tm]]
        rs = [r for r in rs if not math.isnan(r)]
        if rs:
            out[m] = f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"
    return out


if __name__ == "__main__":
    main()
