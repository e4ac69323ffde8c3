"""The ggml expert kernel: down(silu(gate x) * (up x)) computed on the quantised bytes of the GGUF.

Why: the numpy kernel dequantises every expert it touches to float32, so a worker holding a 340 MB
Q4_K shard grows to ~2.4 GB and spends most of its time streaming float32 weights. Here the weights
are never copied: every ggml tensor's ``data`` points into the memory map of the GGUF
(:func:`ggml_backend_cpu_buffer_from_ptr` wraps the mapping, :func:`ggml_backend_tensor_alloc`
places each expert's slab in it), so resident memory is the pages of the shard that were read, plus
a fixed overhead, and a decode step streams the quantised bytes once.

The library is llama.cpp's own libggml (``libggml-base`` + ``libggml-cpu``), driven through ctypes:
the same kernels llama.cpp runs, including its tiled K-quant GEMM for batches (see docs/kernels.md
for the choice and the numbers). ``pip install`` builds it from the ggml that llama-cpp-python
0.3.36 vendors and ships it in ``p2pswarm/_native/`` (``native/build_ggml.py``); that copy is used
first, then llama-cpp-python's ``llama_cpp/lib``. Set ``P2PSWARM_GGML_LIB`` to a directory holding
another build's libggml-base/libggml-cpu (e.g. one compiled for a phone's CPU), or
``P2PSWARM_GGML=off`` to pretend ggml is missing.

Our copy and llama-cpp-python's can both be in one process (the tests compare the two). They
cannot collide: ours has its own file names and sonames, and is opened ``RTLD_LOCAL |
RTLD_DEEPBIND``, so its symbols never enter the global scope (llama.cpp cannot bind to them) and its
own references resolve inside it and its libggml-base first (it cannot bind to llama.cpp's, even
where that copy was opened ``RTLD_GLOBAL``; llama-cpp-python 0.3.36 opens it ``RTLD_LOCAL``).

This module loads the library, binds the functions p2pswarm calls (:class:`GgmlLib`), names the
build (:attr:`GgmlLib.kernel_id`) and sizes its thread team; building and running graphs, and the
weights as views of the memory map, are :mod:`p2pswarm.engine.ggml.runner`.

Only stable *functions* of the ggml API are used, never the layout of ``struct ggml_tensor`` (which
changes between versions), and every shape/type/size is checked in Python first: a failed
``GGML_ASSERT`` aborts the whole process, it cannot be caught.

Numerics are llama.cpp's, not numpy's: before a quantised mat-mul ggml rounds the activations to
the weight type's ``vec_dot_type`` (Q8_K for K-quants, Q8_0 for Q8_0/Q4_0/..., F16 for F16).
Results are deterministic and independent of the thread count, so two nodes running the same
library on the same CPU family get the same bits; :attr:`GgmlLib.kernel_id` names what the library
is (ggml version, llama.cpp commit, machine, the SIMD code paths compiled in) so that peers computing
differently refuse each other at the handshake, and the same ggml built by us or by
llama-cpp-python gets the same id.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from p2pswarm import settings
from p2pswarm.errors import UserError

log = logging.getLogger("p2pswarm.engine")

ENV_LIB = settings.GGML_LIB.name
ENV_DISABLE = settings.GGML.name  # "off" / "0" / "no": behave as if ggml could not be loaded
ENV_THREADS = settings.THREADS.name

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
# Weight types the kernel accepts (ggml's enum values, the same numbers GGUF uses): the ones the
# numpy kernel also reads, so the two kernels cover the same models.
WEIGHT_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 39: "MXFP4"}
QUANTISED_TYPES = frozenset(WEIGHT_TYPES) - {0, 1, 30}
TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT: buffers and tensor data must be aligned to it
# Code paths compiled into libggml-cpu that select different SIMD code (and so possibly different
# rounding): every ggml_cpu_has_* of ggml 0.25 that reports an instruction set, and llamafile (its
# sgemm takes batched F32/F16/Q8_0/K-quant mat-muls). ggml answers these from its compile-time flags.
_CPU_FEATURES = ("sse3", "ssse3", "avx", "avx2", "bmi2", "f16c", "fma", "avx_vnni", "avx512", "avx512_vbmi",
                 "avx512_vnni", "avx512_bf16", "amx_int8", "neon", "arm_fma", "fp16_va", "dotprod",
                 "matmul_int8", "sve", "sme", "sme2", "riscv_v", "vsx", "vxe", "wasm_simd", "llamafile")
# Where ``pip install`` puts the libraries it builds (native/build_ggml.py).
NATIVE_DIR = Path(__file__).resolve().parents[2] / "_native"
NATIVE_STEMS = ("p2pswarm-ggml-base", "p2pswarm-ggml-cpu")
BUILD_SCRIPT = NATIVE_DIR.parents[1] / "native" / "build_ggml.py"  # present in a source checkout
# ours first, else the names llama.cpp's own builds use
_STEMS = {"base": ("p2pswarm-ggml-base", "ggml-base"), "cpu": ("p2pswarm-ggml-cpu", "ggml-cpu")}
# RTLD_LOCAL: our symbols stay out of the global scope; RTLD_DEEPBIND: our references resolve in
# our own libraries before the global scope (where a copy of llama.cpp's opened RTLD_GLOBAL would be).
_DLOPEN_MODE = ctypes.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0)
# Below this many multiply-adds per thread a graph runs on fewer threads: spinning up threads and
# their barriers costs more than they save on tiny experts (the result does not depend on it).
MIN_MACS_PER_THREAD = 1 << 21


class GgmlUnavailable(UserError):
    """libggml could not be found or loaded, or is unusable here; the message says why."""


class _InitParams(ctypes.Structure):
    # struct ggml_init_params: stable since ggml's first release.
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_P = ctypes.c_void_p
_SIG = {  # name: (library, restype, argtypes)
    "ggml_init": ("base", _P, [_InitParams]),
    "ggml_free": ("base", None, [_P]),
    "ggml_reset": ("base", None, [_P]),
    "ggml_tensor_overhead": ("base", ctypes.c_size_t, []),
    "ggml_graph_overhead_custom": ("base", ctypes.c_size_t, [ctypes.c_size_t, ctypes.c_bool]),
    "ggml_new_tensor_1d": ("base", _P, [_P, ctypes.c_int, ctypes.c_int64]),
    "ggml_new_tensor_2d": ("base", _P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
    "ggml_new_tensor_3d": ("base", _P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
    "ggml_view_3d": ("base", _P, [_P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t,
                                  ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_mul_mat_id": ("base", _P, [_P, _P, _P, _P]),
    "ggml_mul_mat": ("base", _P, [_P, _P, _P]),
    "ggml_swiglu_split": ("base", _P, [_P, _P, _P]),
    "ggml_get_rows": ("base", _P, [_P, _P, _P]),
    "ggml_new_graph_custom": ("base", _P, [_P, ctypes.c_size_t, ctypes.c_bool]),
    "ggml_build_forward_expand": ("base", None, [_P, _P]),
    "ggml_get_data": ("base", _P, [_P]),
    "ggml_nbytes": ("base", ctypes.c_size_t, [_P]),
    "ggml_row_size": ("base", ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
    "ggml_blck_size": ("base", ctypes.c_int64, [ctypes.c_int]),
    "ggml_version": ("base", ctypes.c_char_p, []),
    "ggml_commit": ("base", ctypes.c_char_p, []),
    "ggml_quantize_chunk": ("base", ctypes.c_size_t,
                            [ctypes.c_int, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P]),
    "ggml_backend_cpu_buffer_from_ptr": ("base", _P, [_P, ctypes.c_size_t]),
    "ggml_backend_buffer_free": ("base", None, [_P]),
    "ggml_backend_tensor_alloc": ("base", ctypes.c_int, [_P, _P, _P]),
    "ggml_backend_graph_compute": ("base", ctypes.c_int, [_P, _P]),
    "ggml_backend_free": ("base", None, [_P]),
    "ggml_cpu_init": ("cpu", None, []),
    "ggml_backend_cpu_init": ("cpu", _P, []),
    "ggml_backend_cpu_set_n_threads": ("cpu", None, [_P, ctypes.c_int]),
}
# Looked up too, but a libggml without them still loads (their callers fall back to numpy).
_OPTIONAL_SIG = {
    # q, k, v, g, beta, state, K (snapshot slots): llama.cpp's fused Gated DeltaNet (ggml >= 0.25)
    "ggml_gated_delta_net": ("base", _P, [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int64]),
    # a type's CPU traits (from_float, vec_dot_type): expert inputs shipped pre-quantised (ggml/inputs.py)
    "ggml_get_type_traits_cpu": ("cpu", _P, [ctypes.c_int]),
    # the ops of a whole layer in one graph (norms, activations, conv, views, RoPE, softmax), as
    # llama.cpp builds qwen35moe's layers; a libggml without one keeps the per-piece path
    **{f"ggml_{n}": ("base", _P, [_P, _P]) for n in (
        "sigmoid", "silu", "softplus", "exp", "neg", "cont", "transpose", "sqr", "sqrt", "sum_rows")},
    **{f"ggml_{n}": ("base", _P, [_P, _P, _P]) for n in ("mul", "add", "sub", "div", "cpy", "ssm_conv")},
    # in-place forms (the result is the first operand's memory): a layer graph's scratch stays small
    **{f"ggml_{n}_inplace": ("base", _P, [_P, _P]) for n in ("sigmoid", "silu", "softplus")},
    **{f"ggml_{n}_inplace": ("base", _P, [_P, _P, _P]) for n in ("mul", "add")},
    "ggml_scale_inplace": ("base", _P, [_P, _P, ctypes.c_float]),
    # gpt-oss experts: a per-expert bias row picked by id, and the clamped SwiGLU (alpha, limit)
    "ggml_add_id": ("base", _P, [_P, _P, _P, _P]),
    "ggml_swiglu_oai": ("base", _P, [_P, _P, _P, ctypes.c_float, ctypes.c_float]),
    "ggml_rms_norm": ("base", _P, [_P, _P, ctypes.c_float]),
    "ggml_l2_norm": ("base", _P, [_P, _P, ctypes.c_float]),
    "ggml_scale": ("base", _P, [_P, _P, ctypes.c_float]),
    "ggml_concat": ("base", _P, [_P, _P, _P, ctypes.c_int]),
    "ggml_set_rows": ("base", _P, [_P, _P, _P, _P]),
    "ggml_soft_max_ext": ("base", _P, [_P, _P, _P, ctypes.c_float, ctypes.c_float]),
    # a soft_max node, the per-head sink logits (gpt-oss): one more logit in each row, no value
    "ggml_soft_max_add_sinks": ("base", None, [_P, _P]),
    "ggml_new_tensor_4d": ("base", _P, [_P, ctypes.c_int] + [ctypes.c_int64] * 4),
    "ggml_view_1d": ("base", _P, [_P, _P, ctypes.c_int64, ctypes.c_size_t]),
    "ggml_view_2d": ("base", _P, [_P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_view_4d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 4 + [ctypes.c_size_t] * 4),
    "ggml_reshape_2d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 2),
    "ggml_reshape_3d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 3),
    "ggml_reshape_4d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 4),
    "ggml_cont_2d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 2),
    "ggml_cont_3d": ("base", _P, [_P, _P] + [ctypes.c_int64] * 3),
    "ggml_permute": ("base", _P, [_P, _P] + [ctypes.c_int] * 4),
    # a, positions, freq factors (NULL), n_dims, sections[4], mode, n_ctx_orig, freq_base,
    # freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
    "ggml_rope_multi": ("base", _P, [_P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                     ctypes.c_int] + [ctypes.c_float] * 6),
    # a, positions, freq factors (NULL), n_dims, mode, n_ctx_orig, then the six floats above (deepseek2's YaRN)
    "ggml_rope_ext": ("base", _P, [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_float] * 6),
    # ctx, type, ne0..ne3, args (ggml_tensor **), n_args, fun (a CUSTOM_OP), n_tasks, userdata: a node
    # whose value a Python function computes (the router's top-k inside a decode step's one graph)
    "ggml_custom_4d": ("base", _P, [_P, ctypes.c_int] + [ctypes.c_int64] * 4 + [_P, ctypes.c_int, _P, ctypes.c_int, _P]),
}

#: ``ggml_custom_op_t``: ``void (*)(struct ggml_tensor * dst, int ith, int nth, void * userdata)``
CUSTOM_OP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)


#: libgomp spin iterations before a waiting ggml thread sleeps (``GOMP_SPINCOUNT``), p2pswarm's default
SPIN_BEFORE_SLEEP = 1000


def _short_omp_waits() -> None:
    """Let ggml's OpenMP threads spin briefly, then sleep, while they wait (unless the user chose).

    Why: llama-cpp-python's libggml-cpu is built with OpenMP, so its threads are libgomp's team and
    every barrier inside a graph (one per node) and the gap between graphs are libgomp waits.
    libgomp's default spins ~300,000 iterations (7.5 ms here) before it sleeps: a backbone that
    shares its cores (workers on the same host, its own event loop) then burns the timeslice the
    thread it waits for needs (measured on a loaded 2-core machine, geometry-122b qwen35moe decode:
    0.4-0.5 tok/s spinning, 1.8 tok/s with no spin). No spin at all costs a sleep and a wake-up per
    wait instead: ~22 us a barrier on this 2-core VM against ~4 us spinning, ~50 waits per gpt-oss
    decode step (bench/bench_omp_wait.py, docs/benchmarks.md "Short spin"). So waits spin
    ``SPIN_BEFORE_SLEEP`` iterations (25 ns each on this machine's EPYC: 25 us, about what a
    sleep and wake-up cost), then sleep: the classic spin-then-block rule, which never wastes more
    than about one wake-up's time per wait on a loaded machine and catches most waits on an idle
    one. libgomp reads it once, when it is loaded, so it is set before libggml-cpu loads; a process
    that loaded libgomp earlier (e.g. imported llama_cpp first) keeps its policy, and a user who
    set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` keeps theirs.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_BEFORE_SLEEP)


class GgmlLib:
    """libggml-base + libggml-cpu loaded through ctypes, with the signatures we use declared.

    ``origin`` says where they came from: "p2pswarm" (built by pip install), "llama-cpp-python",
    or "$P2PSWARM_GGML_LIB".
    """

    # The C functions of _SIG and _OPTIONAL_SIG, without their ggml_ prefix, bound by __init__:
    # declared here so a type checker sees them (tests/test_ggml_kernel.py checks both lists agree).
    # Arguments are ctypes-converted (pointers as int, ctypes arrays), hence "...".
    init: Callable[..., int | None]
    free: Callable[..., None]
    reset: Callable[..., None]
    tensor_overhead: Callable[..., int]
    graph_overhead_custom: Callable[..., int]
    new_tensor_1d: Callable[..., int | None]
    new_tensor_2d: Callable[..., int | None]
    new_tensor_3d: Callable[..., int | None]
    view_3d: Callable[..., int | None]
    mul_mat_id: Callable[..., int | None]
    mul_mat: Callable[..., int | None]
    swiglu_split: Callable[..., int | None]
    get_rows: Callable[..., int | None]
    new_graph_custom: Callable[..., int | None]
    build_forward_expand: Callable[..., None]
    get_data: Callable[..., int | None]
    nbytes: Callable[..., int]
    row_size: Callable[..., int]
    blck_size: Callable[..., int]
    version: Callable[..., bytes | None]
    commit: Callable[..., bytes | None]
    quantize_chunk: Callable[..., int]
    backend_cpu_buffer_from_ptr: Callable[..., int | None]
    backend_buffer_free: Callable[..., None]
    backend_tensor_alloc: Callable[..., int]
    backend_graph_compute: Callable[..., int]
    backend_free: Callable[..., None]
    cpu_init: Callable[..., None]
    backend_cpu_init: Callable[..., int | None]
    backend_cpu_set_n_threads: Callable[..., None]
    # optional: None where this libggml lacks them (their callers keep a numpy path)
    gated_delta_net: Callable[..., int | None] | None
    get_type_traits_cpu: Callable[..., int | None] | None
    sigmoid: Callable[..., int | None] | None
    silu: Callable[..., int | None] | None
    softplus: Callable[..., int | None] | None
    exp: Callable[..., int | None] | None
    neg: Callable[..., int | None] | None
    cont: Callable[..., int | None] | None
    transpose: Callable[..., int | None] | None
    sqr: Callable[..., int | None] | None
    sqrt: Callable[..., int | None] | None
    sum_rows: Callable[..., int | None] | None
    mul: Callable[..., int | None] | None
    add: Callable[..., int | None] | None
    sub: Callable[..., int | None] | None
    div: Callable[..., int | None] | None
    cpy: Callable[..., int | None] | None
    ssm_conv: Callable[..., int | None] | None
    sigmoid_inplace: Callable[..., int | None] | None
    silu_inplace: Callable[..., int | None] | None
    softplus_inplace: Callable[..., int | None] | None
    mul_inplace: Callable[..., int | None] | None
    add_inplace: Callable[..., int | None] | None
    scale_inplace: Callable[..., int | None] | None
    add_id: Callable[..., int | None] | None
    swiglu_oai: Callable[..., int | None] | None
    rms_norm: Callable[..., int | None] | None
    l2_norm: Callable[..., int | None] | None
    scale: Callable[..., int | None] | None
    concat: Callable[..., int | None] | None
    set_rows: Callable[..., int | None] | None
    soft_max_ext: Callable[..., int | None] | None
    soft_max_add_sinks: Callable[..., None] | None
    new_tensor_4d: Callable[..., int | None] | None
    view_1d: Callable[..., int | None] | None
    view_2d: Callable[..., int | None] | None
    view_4d: Callable[..., int | None] | None
    reshape_2d: Callable[..., int | None] | None
    reshape_3d: Callable[..., int | None] | None
    reshape_4d: Callable[..., int | None] | None
    cont_2d: Callable[..., int | None] | None
    cont_3d: Callable[..., int | None] | None
    permute: Callable[..., int | None] | None
    rope_multi: Callable[..., int | None] | None
    rope_ext: Callable[..., int | None] | None
    custom_4d: Callable[..., int | None] | None


    def __init__(self, lib_dir: Path, origin: str = "?"):
        self.lib_dir = lib_dir
        _short_omp_waits()
        self.origin = origin
        libs = {}
        self.paths: dict[str, Path] = {}
        for key in ("base", "cpu"):  # base first: libggml-cpu's dependency on it is then this copy
            path = _find_lib(lib_dir, _STEMS[key])
            if path is None:
                raise GgmlUnavailable(f"no lib{_STEMS[key][-1]} shared library in {lib_dir}")
            try:
                libs[key] = ctypes.CDLL(str(path), mode=_DLOPEN_MODE)
            except OSError as exc:
                raise GgmlUnavailable(f"cannot load {path.name}: {exc}") from None
            self.paths[key] = path
        for name, (lib, restype, argtypes) in _SIG.items():
            try:
                fn = getattr(libs[lib], name)
            except AttributeError:
                raise GgmlUnavailable(f"lib{lib} in {lib_dir} has no {name} (too old a ggml?)") from None
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("ggml_"), fn)
        for name, (lib, restype, argtypes) in _OPTIONAL_SIG.items():
            fn = getattr(libs[lib], name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("ggml_"), fn)
        self._libs = libs
        self.cpu_init()
        self.ggml_version = (self.version() or b"?").decode()
        self.ggml_commit = (self.commit() or b"?").decode()
        self.features = tuple(f for f in _CPU_FEATURES if _has(libs["cpu"], f))
        self.tensor_overhead_bytes = int(self.tensor_overhead())
        self.kernel_id = make_kernel_id(self.ggml_version, self.ggml_commit, platform.machine(), self.features)

    def has(self, *ops: str) -> bool:
        """Whether this library binds every op in ``ops`` (names without ``ggml_``): the optional
        ones (:data:`_OPTIONAL_SIG`) are None where the library is too old to have them."""
        return all(self.__dict__.get(op) is not None for op in ops)

    def describe(self) -> str:
        return f"{self.kernel_id} (ggml {self.ggml_version} {self.ggml_commit}, {self.origin}: {self.lib_dir})"


def make_kernel_id(version: str, commit: str, machine: str, features) -> str:
    """The string peers compare at the handshake: the same ggml source (version and llama.cpp commit)
    running the same SIMD code paths on the same machine type computes the same bits.

    ggml's build appends "-dirty" to the commit whenever git's index disagrees with the files' stat
    data, which is every build from an unpacked sdist (llama-cpp-python's included); it says nothing
    about the sources, so it is dropped. A build without git reports "unknown" and so never matches
    a build that knows its commit: a refusal, never a silent mismatch.
    """
    commit = commit.removesuffix("-dirty")
    return f"ggml-{version}-{commit}/{machine}" + "".join("+" + f for f in features)


def _has(cpu_lib, feature: str) -> bool:
    fn = getattr(cpu_lib, f"ggml_cpu_has_{feature}", None)
    if fn is None:
        return False
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn())


def _find_lib(lib_dir: Path, stems: tuple[str, ...]) -> Path | None:
    for stem in stems:
        for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll", f"lib{stem}.so.0"):
            if (lib_dir / name).exists():
                return lib_dir / name
    return None


_lib: GgmlLib | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def load_libggml() -> GgmlLib:
    """The process-wide libggml, loaded on first use; :class:`GgmlUnavailable` says why not."""
    global _lib, _lib_error
    if not settings.GGML.get():
        raise GgmlUnavailable(f"disabled by {ENV_DISABLE}={settings.GGML.raw()}")
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise GgmlUnavailable(_lib_error)
        try:
            lib_dir, origin = _locate()
            _lib = GgmlLib(lib_dir, origin)
        except GgmlUnavailable as exc:
            _lib_error = str(exc)
            raise
        log.debug("ggml kernel: %s", _lib.describe())
        return _lib


def _locate() -> tuple[Path, str]:
    """Where libggml is, and whose it is: $P2PSWARM_GGML_LIB, else the copy pip install built into
    p2pswarm/_native/, else llama-cpp-python's lib/ (found without importing it: importing llama_cpp
    would also load libllama, ~4 MB of code a worker never runs)."""
    env = settings.GGML_LIB.raw()
    if env:
        d = Path(env)
        if not d.is_dir():
            raise GgmlUnavailable(f"{ENV_LIB}={env} is not a directory")
        return d, f"${ENV_LIB}"
    if _find_lib(NATIVE_DIR, (NATIVE_STEMS[0],)) and _find_lib(NATIVE_DIR, (NATIVE_STEMS[1],)):
        return NATIVE_DIR, "p2pswarm"
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "lib"
        if _find_lib(d, _STEMS["base"]):
            return d, "llama-cpp-python"
    raise GgmlUnavailable(f"libggml is not built: {NATIVE_DIR} has no lib{NATIVE_STEMS[0]}; {how_to_get_ggml()}")


def how_to_get_ggml() -> str:
    """The exact commands that give this p2pswarm its libggml (for the fallback warning)."""
    if BUILD_SCRIPT.is_file():  # a source checkout (e.g. run with PYTHONPATH, never installed)
        root = BUILD_SCRIPT.parents[1]
        return (f"build it with `python {BUILD_SCRIPT}` (about a minute; needs a C/C++ compiler and cmake) "
                f"or install with `pip install -e {root}`")
    return "reinstall p2pswarm with pip (it builds libggml; needs a C/C++ compiler)"


def default_threads() -> int:
    """$P2PSWARM_THREADS, else the CPUs this process may run on (at most 8: beyond that a single
    expert's mat-muls are memory-bound and more threads only add barrier cost)."""
    n = settings.THREADS.get()
    if n is not None:
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def check_threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise UserError(f"threads must be a positive integer, got {threads!r}")
    return threads


def quantize(ggml_type: int, w: np.ndarray, lib: GgmlLib | None = None) -> np.ndarray:
    """float32 (rows, cols) -> ggml's quantised bytes (llama.cpp's own quantiser; any type ggml
    writes, including the K-quants gguf-py cannot). For tests and benchmarks."""
    lib = lib or load_libggml()
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    if cols % int(lib.blck_size(ggml_type)):
        raise ValueError(f"{cols} columns is not a multiple of the block size")
    out = np.zeros(int(lib.row_size(ggml_type, cols)) * rows, np.uint8)
    n = lib.quantize_chunk(ggml_type, w.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    if n != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes, expected {out.nbytes}")
    return out
