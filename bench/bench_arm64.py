"""An aarch64 worker (qemu-user) computing the experts of an x86-64 backbone: how far apart are they?

    python bench/bench_arm64.py [--tokens 32] [--requests 40]

Needs the aarch64 test bed (tests/helpers/arm64_root.py builds and caches it). A tiny qwen35moe
Q4_K_M model (Q4_K gate/up, Q6_K down) is made here; ``p2pswarm worker`` serves all its experts from
inside the arm64 root, once with the ggml kernel (libggml cross-compiled for aarch64) and once with
the portable kernel. The x86-64 side runs the model's dense path and, at every layer of a 32-token
prefill, sends the routed groups to the aarch64 worker *and* computes them with the same kernel
here; the aarch64 results drive the forward pass (as in a real split), so routing differences
propagate as they would. Reported per kernel:

- max |Δ| / max |out| over every expert output (and how many of them were not bit-equal);
- (layer, position)s whose top-k experts differ from the all-x86 run; max |Δ logit|;
- the aarch64 worker's decode requests/s under emulation (8 experts x 1 row per request, as a
  worker receives them in decode), for the record: qemu is ~10-50x slower than a real phone core.

The ggml kernel's aarch64 worker is reached with its own kernel id in the hello: a deliberate
bypass of the handshake (that refusal is the point of the kernel families), for measurement only.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import trio
from common import REPO, header

sys.path.insert(0, str(REPO / "tests"))
from helpers import arm64_root as bed

from p2pswarm.backbone.serving.runner import combine, expert_groups
from p2pswarm.backbone.owners.socket_owner import SocketOwner
from p2pswarm.engine.arch import load_dense
from p2pswarm.engine.kernels import make_bank
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.model.slicer import slice_experts
from p2pswarm.model.synth import make_model


def start_root_worker(root, inside, shard_in: str, kernel: str, env: dict) -> bed.RootProcess:
    return bed.RootProcess(root, inside, ["worker", "--shard", shard_in, "--listen", "127.0.0.1:0", "--kernel", kernel,
                                          "--threads", "1"], env=env)


async def run_prefill(model_path: Path, bank, tokens: list[int], owner: SocketOwner | None = None):
    """Prefill with the experts from ``owner`` (aarch64) when given, else from ``bank`` (x86); with an
    owner, ``bank`` also computes every group here, to compare. Returns (logits, sorted top-k per
    layer, max relative |Δ| of an expert output, outputs not bit-equal, outputs compared)."""
    layout = ModelLayout.open(model_path)
    model = load_dense(layout)
    state = model.new_state()
    h = model.embed(np.asarray(tokens))
    dmax, unequal, n_out, routes = 0.0, 0, 0, []
    for il in range(model.n_layer):
        h = model.pre_moe(il, h, state, 0)
        cur = model.ffn_input(il, h)
        ids, w = model.route(il, cur)
        routes.append(np.sort(ids, axis=1))
        groups = expert_groups(ids)
        local = bank.forward_groups(il, cur, groups)
        outs = local if owner is None else await owner.compute(il, cur, groups)
        for r, loc in zip(outs, local):
            n_out += 1
            unequal += not np.array_equal(r.view(np.int32), loc.view(np.int32))
            dmax = max(dmax, float(np.abs(r - loc).max() / max(np.abs(loc).max(), 1e-30)))
        h = model.post_moe(il, h, cur, combine(ids, w, groups, dict(zip([e for e, _ in groups], outs))))
    return model.output(h), routes, dmax, unequal, n_out


async def requests_per_s(owner: SocketOwner, layout, n: int) -> float:
    rng = np.random.default_rng(0)
    E = int(layout.hparam("embedding_length", required=True))
    layer = layout.expert_layers[0]
    row = rng.standard_normal((8, E)).astype(np.float32)
    groups = [(e, np.array([i])) for i, e in enumerate(range(8))]
    await owner.compute(layer, row, groups)  # warm: connect, first-touch the pages
    t0 = time.perf_counter()
    for _ in range(n):
        await owner.compute(layer, row, groups)
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args(argv)
    root = bed.ensure_root()
    ggml_dir = bed.ensure_libggml(root)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    inside = bed.stage_project(root, name)
    work = root / "opt" / name
    tmp = Path(tempfile.mkdtemp(prefix="bench-arm64-"))
    model_path = tmp / "q35-q4_k_m.gguf"
    make_model(model_path, arch="qwen35moe", preset="tiny", qtype="q4_k_m", seed=5)
    shard = work / "shard.gguf"
    slice_experts(model_path, shard, None, (0, ModelLayout.open(model_path).n_expert))
    shard_in = str(inside / "shard.gguf")
    layout = ModelLayout.open(model_path)
    fp = model_fingerprint(layout)
    tokens = [int(t) for t in np.random.default_rng(3).integers(1, 400, args.tokens)]
    lines = [header("aarch64 worker (qemu-user) against x86-64", f"python bench/bench_arm64.py --tokens {args.tokens} "
                                                                  f"--requests {args.requests}"),
             f"tiny qwen35moe Q4_K_M (Q4_K gate/up, Q6_K down; {layout.n_expert} experts, {len(layout.expert_layers)} "
             f"layers), {args.tokens}-token prefill; the aarch64 worker's outputs drive the forward pass.\n\n",
             "| kernel | aarch64 kernel id | expert outputs not bit-equal | max \\|Δ\\| / max \\|out\\| | (layer, pos) "
             "routed differently | max \\|Δ logit\\| | aarch64 worker decode requests/s (qemu) |\n",
             "|---|---|---|---|---|---|---|\n"]
    try:
        for kernel in ("ggml", "portable"):
            env = {"P2PSWARM_GGML_LIB": str(ggml_dir)} if kernel == "ggml" else {}
            proc = start_root_worker(root, inside, shard_in, kernel, env)
            host, port = proc.where.rsplit(":", 1)
            try:
                bank = make_bank(layout, kernel, threads=1)
                worker_kernel = _worker_kernel(root, inside, shard_in, kernel, env)
                owner = SocketOwner("arm64", host, int(port), model_fingerprint=fp, kernel=worker_kernel,
                                    layers=(min(layout.expert_layers), max(layout.expert_layers) + 1),
                                    experts=(0, layout.n_expert), timeout_s=600)

                async def go():
                    split = await run_prefill(model_path, bank, tokens, owner)
                    rps = await requests_per_s(owner, layout, args.requests)
                    await owner.aclose()
                    return split, rps

                (logits, routes, dmax, unequal, n_out), rps = trio.run(go)
                ref_logits, ref_routes, *_ = trio.run(run_prefill, model_path, bank, tokens)
                changed = sum(int((a != b).any(axis=1).sum()) for a, b in zip(routes, ref_routes))
                dlogit = float(np.abs(logits - ref_logits).max())
                row = (f"| {kernel} | `{worker_kernel}` | {unequal} of {n_out} | {dmax:.2e} | {changed} of "
                       f"{len(routes) * args.tokens} | {dlogit:.3g} | {rps:.1f} |\n")
                print(row, end="", file=sys.stderr, flush=True)
                lines.append(row)
            finally:
                proc.stop()
    finally:
        bed.unstage(root, name)
    print("".join(lines))
    return 0


def _worker_kernel(root, inside, shard_in: str, kernel: str, env: dict) -> str:
    """The kernel id the aarch64 worker reports (what its hello must carry)."""
    r = bed.run_in_root(root, ["/usr/bin/python3", "-c", "import sys; from p2pswarm.engine.kernels import kernel_id; "
                               f"print(kernel_id({kernel!r}))"], pythonpath=inside, env=env,
                        capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"kernel id in the root: {r.stderr[-500:]}")
    return r.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    sys.exit(main())
