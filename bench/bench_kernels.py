"""One 122B-geometry expert (3072x1024) through every kernel, for 1, 8, 64 and 256 rows.

    python bench/bench_kernels.py [--threads N] [--experts 64] [--repeat 5]

Two expert files, written here from one expert quantised by ggml's own quantiser and repeated
``--experts`` times (so each expert has its own bytes in memory): gate/up/down all Q4_K, and
gate/up Q4_K with down Q6_K (the mix a Q4_K_M file has). Per row count, ms per expert call of:

- numpy: :class:`ExpertBank` with its float32 weights already cached (the reference kernel);
- ggml: :class:`GgmlExpertBank` on the memory-mapped quantised bytes (our kernel);
- llama.cpp: the same graph through the same libggml the way llama.cpp runs a MoE layer on the CPU:
  ``ggml_mul_mat_id`` over the 3-D expert tensors, once with the weights in place in the memory map
  (llama.cpp with ``--no-repack``, or any weights its repack code does not take) and once repacked
  into the CPU_REPACK buffer (llama.cpp's default; Q4_K/Q6_K are repacked to 8x8 interleaved blocks
  on x86 with AVX2+). "llama.cpp best" is the faster of the two;
- stream: reading the expert's bytes and nothing else (the memory-bandwidth floor), with 1 or N
  threads, whichever is faster.

"cold" cycles through all experts (a 340 MB working set: every call streams from DRAM, as a worker
serving a real shard does); "hot" repeats one expert (its 5.3 MB stay in the last-level cache).
Ratios are taken within one run: decode = ggml(1 row) / stream (goal <= 1.6), batched =
llama.cpp best / ggml (goal >= 0.5: at least half llama.cpp's throughput). The decode section at the
end alternates 1 and N threads and the stream floor in rounds, for ratios that survive a noisy host.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from common import header

from p2pswarm.engine.ggml import lib as gk
from p2pswarm.engine.experts import ggml_bank as ggml_experts
from p2pswarm.engine.ggml import runner as ggml_runner
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.engine.ggml.mapped_parts import map_layout
from p2pswarm.model.gguf_out import GGUFLayout, kv_string, kv_uint32, pad
from p2pswarm.model.layout import ModelLayout

E, FF = 3072, 1024
Q4_K, Q6_K = 12, 14
ROWS = (1, 8, 64, 256)


def write_expert_file(path: Path, down_type: int, n_expert: int) -> Path:
    """A minimal qwen3moe GGUF with one layer of ``n_expert`` identical experts (ggml-quantised)."""
    if path.exists():
        return path
    lib = gk.load_libggml()
    rng = np.random.default_rng(0)
    gate = gk.quantize(Q4_K, rng.standard_normal((FF, E), np.float32) * 0.02, lib)
    up = gk.quantize(Q4_K, rng.standard_normal((FF, E), np.float32) * 0.02, lib)
    down = gk.quantize(down_type, rng.standard_normal((E, FF), np.float32) * 0.02, lib)
    g = GGUFLayout()
    for key, val in (("qwen3moe.block_count", 1), ("qwen3moe.expert_count", n_expert),
                     ("qwen3moe.expert_used_count", 8), ("qwen3moe.embedding_length", E),
                     ("qwen3moe.expert_feed_forward_length", FF)):
        g.add_raw_kv(kv_uint32(key, val))
    g.add_raw_kv(kv_string("general.architecture", "qwen3moe"))
    parts = (("gate", gate, Q4_K, (n_expert, FF, E)), ("up", up, Q4_K, (n_expert, FF, E)),
             ("down", down, down_type, (n_expert, E, FF)))
    for kind, blob, t, shape in parts:
        g.add_tensor(f"blk.0.ffn_{kind}_exps.weight", t, shape, blob.nbytes * n_expert)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        head = g.header()
        f.write(head)
        for (_, blob, _, _), entry in zip(parts, g.tensors):
            f.seek(len(head) + entry.offset)
            for _ in range(n_expert):
                f.write(blob.tobytes())
        end = len(head) + g.tensors[-1].offset + g.tensors[-1].nbytes
        f.write(b"\0" * (pad(end, 32) - end))
    tmp.rename(path)
    return path


def timed(fn, repeat: int, warmup: int = 1) -> float:
    """Fastest of ``repeat`` runs: on shared cores the slower runs measure the neighbours."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def per_call(fn, experts: list[int], repeat: int) -> float:
    """Fastest of ``repeat`` passes of (one pass over ``experts``) / len(experts), in seconds."""
    return timed(lambda: [fn(e) for e in experts], repeat) / len(experts)


# ---- llama.cpp's MoE op through the same libggml -------------------------------------------------
class LlamaMoe:
    """gate/up/down as 3-D tensors and ``ggml_mul_mat_id``, weights in the map or repacked."""

    def __init__(self, lib: gk.GgmlLib, layout: ModelLayout, threads: int, repack: bool):
        self.lib = lib
        self.n_expert = layout.n_expert
        base, cpu = lib._libs["base"], lib._libs["cpu"]
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        for name, res, args in (("ggml_new_tensor_3d", P, [P, ctypes.c_int, I64, I64, I64]),
                                ("ggml_mul_mat_id", P, [P, P, P, P]),
                                ("ggml_backend_buft_alloc_buffer", P, [P, ctypes.c_size_t]),
                                ("ggml_backend_buffer_get_base", P, [P]),
                                ("ggml_backend_tensor_set", None, [P, P, ctypes.c_size_t, ctypes.c_size_t]),
                                ("ggml_backend_buft_get_alloc_size", ctypes.c_size_t, [P, P])):
            f = getattr(base, name)
            f.restype, f.argtypes = res, args
        self.base = base
        self.runner = ggml_runner.GgmlRunner(lib, threads)
        tensors = layout.expert_tensors[0]
        self.wctx = lib.init(gk._InitParams(16 * lib.tensor_overhead_bytes, None, True))
        self.w = {}
        if repack:
            sym = "_Z35ggml_backend_cpu_repack_buffer_typev"  # C++ symbol: llama.cpp gets it via the registry
            fn = getattr(cpu, sym)
            fn.restype = P
            buft = fn()
            made = {k: base.ggml_new_tensor_3d(self.wctx, int(t.ggml_type), t.shape[2], t.shape[1], t.shape[0])
                    for k, t in tensors.items()}
            sizes = {k: (base.ggml_backend_buft_get_alloc_size(buft, m) + 63) // 64 * 64 for k, m in made.items()}
            self.buffer = base.ggml_backend_buft_alloc_buffer(buft, sum(sizes.values()) + 64)
            ptr = base.ggml_backend_buffer_get_base(self.buffer)
            off = 0
            for k, t in tensors.items():
                assert lib.backend_tensor_alloc(self.buffer, made[k], ptr + off) == 0
                base.ggml_backend_tensor_set(made[k], layout.view(t.data_offset, t.nbytes).ctypes.data, 0, t.nbytes)
                off += sizes[k]
            self.w = made
        else:
            self.mapped = map_layout(lib, layout)  # one file or a split model's parts
            for k, t in tensors.items():
                self.w[k] = self.mapped.tensor(int(t.ggml_type), t.shape[2], t.shape[1], t.data_offset, k, t.shape[0])

    def forward(self, expert: int, x: np.ndarray) -> np.ndarray:
        lib, r, b = self.lib, self.runner, self.base
        n = x.shape[0]
        with r.lock:
            ctx = r.context(4 * n * (3 * E + 3 * FF) + 4096, 16)
            graph = lib.new_graph_custom(ctx, 64, False)
            xt = b.ggml_new_tensor_3d(ctx, gk.GGML_TYPE_F32, E, 1, n)
            ggml_runner.f32_view(lib, xt, (n, E))[...] = x
            ids = lib.new_tensor_2d(ctx, gk.GGML_TYPE_I32, 1, n)
            ids_ptr = ctypes.cast(lib.get_data(ids), ctypes.POINTER(ctypes.c_int32))
            np.ctypeslib.as_array(ids_ptr, shape=(n,))[...] = expert
            g = b.ggml_mul_mat_id(ctx, self.w["gate"], xt, ids)
            u = b.ggml_mul_mat_id(ctx, self.w["up"], xt, ids)
            h = lib.swiglu_split(ctx, g, u)
            out = b.ggml_mul_mat_id(ctx, self.w["down"], h, ids)
            lib.build_forward_expand(graph, out)
            r.compute(graph, 1 << 40)
            res = ggml_runner.f32_view(lib, out, (n, E)).copy()
        return res


def stream_time(layout: ModelLayout, experts: list[int], threads: int, repeat: int) -> float:
    """Seconds to read one expert's bytes (gate+up+down slabs), fastest of 1 and ``threads`` threads."""
    slabs = {e: [t.slab(e) for t in layout.expert_tensors[0].values()] for e in experts}

    def read1(e):
        for off, n in slabs[e]:
            np.bitwise_or.reduce(layout.view(off, n).view(np.uint64))

    best = per_call(read1, experts, repeat)
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            def readn(e):
                parts = []
                for off, n in slabs[e]:
                    step = (n // threads) // 64 * 64
                    parts += [(off + i * step, step if i < threads - 1 else n - i * step) for i in range(threads)]
                list(pool.map(lambda p: np.bitwise_or.reduce(layout.view(p[0], p[1]).view(np.uint64)), parts))
            best = min(best, per_call(readn, experts, repeat))
    return best


def repack_works(path: Path, threads: int) -> bool:
    """Repacking some types has crashed some ggml builds: try it in a child process first."""
    code = ("import sys; sys.path.insert(0, %r); sys.path.insert(0, %r); import numpy as np; "
            "from bench_kernels import LlamaMoe; from p2pswarm.engine.ggml import lib as gk; "
            "from p2pswarm.model.layout import ModelLayout; "
            "m = LlamaMoe(gk.load_libggml(), ModelLayout.open(%r), %d, True); "
            "[m.forward(0, np.ones((n, 3072), np.float32)) for n in (1, 8, 64)]"
            % (str(Path(__file__).parent), str(Path(__file__).parent.parent), str(path), threads))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600).returncode == 0


def bench_file(path: Path, label: str, threads: int, repeat: int) -> str:
    lib = gk.load_libggml()
    layout = ModelLayout.open(path)
    experts = list(range(layout.n_expert))
    rng = np.random.default_rng(1)
    ggml_bank = ggml_experts.GgmlExpertBank(layout, threads=threads)
    numpy_bank = ExpertBank(layout, cache_bytes=16 << 30)
    numpy_experts = experts[:8]  # 8 x 37.7 MB of float32: past the cache, and the RAM stays modest
    llama_plain = LlamaMoe(lib, layout, threads, repack=False)
    can_repack = repack_works(path, threads)
    llama_rep = LlamaMoe(lib, layout, threads, repack=True) if can_repack else None
    stream_cold = stream_time(layout, experts, threads, repeat)
    stream_hot = stream_time(layout, [0], threads, repeat * 20)
    nbytes = layout.expert_bytes(0)
    text = (f"\n### {label}: {nbytes:,} bytes per expert, {len(experts)} experts "
            f"({len(experts) * nbytes / 2**20:.0f} MB), {threads} threads\n\n"
            f"stream floor: cold {stream_cold * 1e3:.3f} ms ({nbytes / stream_cold / 1e9:.1f} GB/s), "
            f"hot {stream_hot * 1e3:.3f} ms ({nbytes / stream_hot / 1e9:.1f} GB/s)\n\n"
            "| rows | numpy (cached f32) | ggml cold | ggml hot | llama.cpp mmap cold | llama.cpp repack cold "
            "| ggml / stream (cold) | ggml / stream (hot) | llama.cpp best / ggml | ggml vs numpy speed-up |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    for n in ROWS:
        x = rng.standard_normal((n, E)).astype(np.float32)
        reps = max(2, repeat if n <= 8 else repeat // 2)
        for e in numpy_experts:
            numpy_bank.forward(0, e, x)  # dequantise into the cache first: time the cached kernel
        t_np = per_call(lambda e: numpy_bank.forward(0, e, x), numpy_experts, max(2, reps // 2))
        t_cold = per_call(lambda e: ggml_bank.forward(0, e, x), experts, reps)
        t_hot = per_call(lambda e: ggml_bank.forward(0, 0, x), [0] * 16, reps)
        t_lp = per_call(lambda e: llama_plain.forward(e, x), experts, reps)
        t_lr = per_call(lambda e: llama_rep.forward(e, x), experts, reps) if llama_rep else float("nan")
        best = min(t_lp, t_lr) if llama_rep else t_lp
        text += (f"| {n} | {t_np * 1e3:.2f} | {t_cold * 1e3:.3f} | {t_hot * 1e3:.3f} | {t_lp * 1e3:.3f} | "
                 f"{t_lr * 1e3:.3f} | {t_cold / stream_cold:.2f}x | {t_hot / stream_hot:.2f}x | "
                 f"{best / t_cold:.2f}x | {t_np / t_cold:.1f}x |\n")
    # A decode step as a worker sees it: one request, 8 experts, one row each (one graph).
    x = rng.standard_normal((1, E)).astype(np.float32)
    batches = [experts[i:i + 8] for i in range(0, len(experts) - 7, 8)]
    t_req = timed(lambda: [ggml_bank.forward_groups(0, x, [(e, np.arange(1)) for e in b]) for b in batches],
                  repeat) / (8 * len(batches))
    text += (f"\nOne decode request of 8 experts x 1 row (one graph), cold: {t_req * 1e3:.3f} ms per expert = "
             f"{t_req / stream_cold:.2f}x the cold stream time.\n")
    if not can_repack:
        text += "\n(repacking this expert's types crashed this ggml build: llama.cpp column is the mmap path)\n"
    ggml_bank.close()
    return text


def decode_section(path: Path, label: str, threads: int, rounds: int = 4) -> str:
    """Decode (1 row) against the stream floor for 1..``threads`` threads, in alternating rounds
    (fastest of all rounds), so a burst of background load hits every column alike."""
    layout = ModelLayout.open(path)
    experts = list(range(layout.n_expert))
    counts = sorted({1, threads})
    banks = {t: ggml_experts.GgmlExpertBank(layout, threads=t) for t in counts}
    x = np.random.default_rng(0).standard_normal((1, E)).astype(np.float32)
    best: dict[str, float] = {}
    jobs = {"stream": lambda: stream_time(layout, experts, threads, 3)}
    for t, b in banks.items():
        jobs[f"cold{t}"] = lambda b=b: per_call(lambda e: b.forward(0, e, x), experts, 3)
        jobs[f"hot{t}"] = lambda b=b: per_call(lambda e: b.forward(0, 0, x), [0] * 32, 3)
        jobs[f"req{t}"] = lambda b=b: per_call(
            lambda e: b.forward_groups(0, x, [(k, np.arange(1)) for k in range(e, e + 8)]), experts[::8], 3) / 8
    for _ in range(rounds):
        for k, fn in jobs.items():
            best[k] = min(best.get(k, float("inf")), fn())
    s = best["stream"]
    text = (f"\n### Decode vs the stream floor, {label} ({rounds} alternating rounds, fastest)\n\n"
            f"stream floor (cold, fastest of 1 and {threads} threads): {s * 1e3:.3f} ms\n\n"
            "| threads | 1 row cold | ratio to floor | 8 experts x 1 row in one request, per expert | ratio "
            "| 1 row hot |\n"
            "|---|---|---|---|---|---|\n")
    for t in counts:
        text += (f"| {t} | {best[f'cold{t}'] * 1e3:.3f} | {best[f'cold{t}'] / s:.2f}x | {best[f'req{t}'] * 1e3:.3f} | "
                 f"{best[f'req{t}'] / s:.2f}x | {best[f'hot{t}'] * 1e3:.3f} |\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=gk.default_threads())
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/p2pswarm-bench")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    lib = gk.load_libggml()
    text = header("Expert kernels: numpy vs ggml vs llama.cpp, one 3072x1024 expert",
                  "python bench/bench_kernels.py")
    text += f"ggml kernel `{lib.kernel_id}`; ms per expert call, fastest of {args.repeat} passes.\n"
    for label, down in (("Q4_K gate/up/down", Q4_K), ("Q4_K gate/up, Q6_K down", Q6_K)):
        path = write_expert_file(d / f"kernels-{args.experts}x-down{down}.gguf", down, args.experts)
        text += bench_file(path, label, args.threads, args.repeat)
        text += decode_section(path, label, max(args.threads, 2))
    print(text)


if __name__ == "__main__":
    main()
