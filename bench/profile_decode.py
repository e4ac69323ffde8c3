"""Where a backbone decode step spends its time: py-spy samples (native frames too) of a decode loop.

    python bench/profile_decode.py --model M.gguf [--steps 24 | --prefill 128 | --seqs 16] [--threads 2] [--tree SRC]

The child process runs the backbone's layer loop for one sequence, token by token, with the ggml
kernel for the dense path and the local experts: the same calls ``Backbone.forward`` makes
(``layer_in``, the local bank's ``forward_groups``, ``combine``, ``layer_out``, ``output``), but synchronously, so every sample is of the engine and not of trio's
thread hand-offs. py-spy attaches after loading and a warm-up and records only the timed steps
(``--native``, all threads, idle threads excluded); this
script prints the functions with the most samples at the top of the stack ("self"), the
engine-level step each sample is in, and how many ggml graphs one step computes.

``--seqs N`` profiles the server's step instead: ``Backbone.forward_batch`` of N sequences' rows
(one token each, the batch-invariant default, after a warm-up step that runs its one-time probes),
through trio's thread hop as the scheduler runs it.
Needs ``py-spy`` (``pip install py-spy==0.4.3``).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# engine-level step of a sample: the first of these names found walking the stack from the top
STEPS = (("forward_groups", "routed experts (ggml mul_mat_id / per-group graphs)"),
         ("deltanet_pre_moe", "DeltaNet layer (one ggml graph: norm, projections, conv, delta rule, out)"),
         ("linear_attention", "DeltaNet layer (projections, conv, delta rule)"),
         ("_linear_attention_rows", "DeltaNet layer (projections, conv, delta rule)"),
         ("gated_attention", "gated attention layer (one ggml graph)"),
         ("full_attention", "gated attention layer (projections + numpy attention)"),
         ("_full_attention_rows", "gated attention layer (projections + numpy attention)"),
         ("shared", "shared expert"),
         ("route", "router (numpy F32)"),
         ("output", "lm head (151,936-token vocabulary)"),
         ("embed", "embedding"),
         ("combine", "combine (numpy)"),
         ("rms_norm", "norms (numpy)"))


def child(a) -> None:
    sys.path.insert(0, str(a.tree))
    import numpy as np

    from p2pswarm.backbone.serving.runner import combine, expert_groups
    from p2pswarm.engine.ggml import runner as ggml_runner
    from p2pswarm.engine.arch import load_dense
    from p2pswarm.engine.kernels import make_bank
    from p2pswarm.model.layout import ModelLayout

    layout = ModelLayout.open(a.model)
    model = load_dense(layout, "ggml", threads=a.threads)
    bank = make_bank(layout, "ggml", threads=a.threads)
    graphs = [0]
    real_compute = ggml_runner.GgmlRunner.compute

    def counting(self, graph, macs):
        graphs[0] += 1
        return real_compute(self, graph, macs)

    ggml_runner.GgmlRunner.compute = counting

    def step(tokens, state):
        h = model.embed(np.asarray(tokens))
        pos0 = state.n_past
        for il in range(model.n_layer):
            lin = model.layer_in(il, h, [(state, pos0, h.shape[0])])
            groups = expert_groups(lin.ids)
            partials = dict(zip([e for e, _ in groups], bank.forward_groups(il, lin.cur, groups)))
            h = model.layer_out(il, lin, combine(lin.ids, lin.weights, groups, partials))
        state.n_past += len(tokens)
        return model.output(h)

    if a.seqs:
        batched(a, graphs)
        return
    state = model.new_state()
    step([(7919 * i + 11) % model.n_vocab for i in range(8)], state)
    for i in range(4):  # warm: the pages of the experts these tokens pick, caches
        step([(104729 * i + 5) % model.n_vocab], state)
    graphs[0] = 0
    print(f"READY {os.getpid()}", flush=True)
    sys.stdin.readline()  # the profiler is attached: only the timed steps are sampled
    t = time.perf_counter()
    if a.prefill:
        step([(7919 * i + 3) % model.n_vocab for i in range(a.prefill)], model.new_state())
    else:
        for i in range(a.steps):
            step([(7919 * i + 3) % model.n_vocab], state)
    dt = time.perf_counter() - t
    print(f"STEPS {a.prefill or a.steps} {dt:.3f} {graphs[0]}", flush=True)


def batched(a, graphs) -> None:
    """``--seqs``: the timed steps are forward_batch calls of every sequence's next token."""
    import trio

    from p2pswarm.backbone.sessions.local import open_backbone

    vocab = [150_000]  # the model's, once it is open

    def toks(n, salt):
        return [(7919 * i + 104729 * salt + 11) % vocab[0] for i in range(n)]

    async def run():
        async with open_backbone(a.model, workers=0, kernel="ggml", threads=a.threads) as swarm:
            b = swarm.backbone
            vocab[0] = b.model.n_vocab
            await b.forward_batch([(toks(2, 50 + i), b.new_state()) for i in range(2)], last_only=True)  # probes
            states = [b.new_state() for _ in range(a.seqs)]
            await b.forward_batch([(toks(4, 10 + i), s) for i, s in enumerate(states)], last_only=True)
            graphs[0] = 0
            print(f"READY {os.getpid()}", flush=True)
            sys.stdin.readline()
            t = time.perf_counter()
            for j in range(a.steps):
                await b.forward_batch([(toks(1, 100 + j * a.seqs + i), s) for i, s in enumerate(states)],
                                      last_only=True)
            print(f"STEPS {a.steps * a.seqs} {time.perf_counter() - t:.3f} {graphs[0]}", flush=True)

    trio.run(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", type=Path, default=REPO, help="p2pswarm source tree to profile (this one)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of N tokens instead")
    ap.add_argument("--seqs", type=int, default=0, help="profile forward_batch steps of N sequences instead")
    ap.add_argument("--dump", help="also write py-spy's raw stacks to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    subprocess.run(["cat", str(a.model)], stdout=subprocess.DEVNULL, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "stacks.txt"
        env = dict(os.environ, PYTHONPATH=str(a.tree), P2PSWARM_THREADS=str(a.threads))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(a.model),
                                 "--steps", str(a.steps), "--threads", str(a.threads), "--tree", str(a.tree),
                                 "--prefill", str(a.prefill), "--seqs", str(a.seqs)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = proc.stdout.readline()
        if not ready.startswith("READY"):
            proc.kill()
            raise SystemExit("the decode loop did not start")
        spy = subprocess.Popen(["py-spy", "record", "--native", "--format", "raw", "--rate", "200", "-o", str(raw),
                                "--pid", ready.split()[1]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        time.sleep(2.0)  # py-spy attaches
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        proc.wait()
        err = spy.communicate()[1]
        if not line.startswith("STEPS") or not raw.exists():
            raise SystemExit(f"profiling failed: {line.strip()} {err.strip()[-300:]}")
        _, n, dt, graphs = line.split()
        stacks = [(s.rsplit(" ", 1)[0].split(";"), int(s.rsplit(" ", 1)[1]))
                  for s in raw.read_text().splitlines() if s.strip()]
        if a.dump:
            Path(a.dump).write_text(raw.read_text())
    self_ = collections.Counter()
    steps = collections.Counter()
    for frames, c in stacks:
        joined = ";".join(frames)
        marker = "forward_batch" if a.seqs else "step ("
        if marker not in joined and "libgomp" not in joined:
            continue  # the main thread outside the timed loop (waiting to start, tearing down)
        name = frames[-1].split(" (")[0]
        if name.startswith("0x") and " (" in frames[-1]:  # no symbol: name the library
            name = "[" + frames[-1].split(" (")[1].rstrip(")").split(":")[0] + ", unnamed]"
        self_[name] += c
        for key, label in STEPS:
            if f"{key} (" in joined:
                steps[label] += c
                break
        else:
            # not under an engine call: the thread team's other threads between and inside
            # graphs (libgomp), or the loop's own Python
            steps["ggml worker threads (libgomp: spinning / waiting for work)" if marker not in joined
                  else "layer loop glue (Python)"] += c
    total = sum(steps.values())
    what = "tokens of one prefill" if a.prefill else f"tokens of {a.seqs} sequences" if a.seqs else "decode steps"
    per = 1 if a.prefill else a.steps
    print(f"{n} {what} in {float(dt):.2f} s ({float(n) / float(dt):.2f} tok/s), "
          f"{int(graphs) / per:.1f} ggml graphs per {'prefill' if a.prefill else 'step'}; "
          f"{total} samples (all threads)\n")
    print("| step of the layer loop | share of samples |\n|---|---|")
    for label, c in steps.most_common():
        print(f"| {label} | {100 * c / total:.1f}% |")
    print("\n| top of stack (self) | share |\n|---|---|")
    for name, c in self_.most_common(a.top):
        print(f"| `{name}` | {100 * c / total:.1f}% |")


if __name__ == "__main__":
    main()
