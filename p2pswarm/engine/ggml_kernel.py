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

import collections
import ctypes
import importlib.util
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import numpy as np

from p2pswarm import settings
from p2pswarm.errors import ModelFormatError, UserError

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
NATIVE_DIR = Path(__file__).resolve().parents[1] / "_native"
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
    # a type's CPU traits (from_float, vec_dot_type): expert inputs shipped pre-quantised (ggml_inputs)
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
}


def _passive_omp_waits() -> None:
    """Let ggml's OpenMP threads sleep, not spin, while they wait (unless the user chose otherwise).

    Why: llama-cpp-python's libggml-cpu is built with OpenMP, so its threads are libgomp's team and
    every barrier inside a graph (one per node) and the gap between graphs are libgomp waits,
    which by default spin for ~300,000 iterations. A backbone runs many small graphs with numpy
    work between them, and often shares its cores (workers on the same host): the spinning thread
    then burns the timeslice the thread it waits for needs. Measured on a loaded 2-core machine
    (bench/profile_decode.py, geometry-122b qwen35moe decode): 0.4-0.5 tok/s spinning, 1.8 tok/s
    passive. libgomp reads the setting once, when it is loaded, so it is set before libggml-cpu
    loads; a process that loaded libgomp earlier (e.g. imported llama_cpp first) keeps its policy.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


class GgmlLib:
    """libggml-base + libggml-cpu loaded through ctypes, with the signatures we use declared.

    ``origin`` says where they came from: "p2pswarm" (built by pip install), "llama-cpp-python",
    or "$P2PSWARM_GGML_LIB".
    """

    def __init__(self, lib_dir: Path, origin: str = "?"):
        self.lib_dir = lib_dir
        _passive_omp_waits()
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


# ---- one place that runs graphs ----------------------------------------------------------------
class GgmlRunner:
    """A CPU backend, a reusable compute context and a lock: build a graph, run it, read it back.

    Weights live elsewhere (in the memory map); this context only holds the activations of one
    call. It is reset, not freed, between calls, and regrown when a call needs more; a context
    grown past ``KEEP_BYTES`` is released after the call so one long prefill does not pin its
    scratch memory forever. With ``graph_cache_bytes``, :meth:`graph` also keeps built graphs,
    each in a context of its own, for the steps that repeat their shapes (the backbone's dense
    path and its expert replica; a worker's runner a few MiB of them, its memory is a phone's).
    """

    KEEP_BYTES = 64 << 20
    #: a kept graph larger than this is not kept (a long prefill's: its shape rarely recurs)
    GRAPH_ENTRY_BYTES = 32 << 20
    #: a kept graph not used in this many graph calls may be dropped to make room for a new one
    STALE_CALLS = 2048
    #: how many keys built once are remembered (a key is kept on its second build)
    SEEN_KEYS = 4096

    def __init__(self, lib: GgmlLib, threads: int | None = None, *, graph_cache_bytes: int = 0):
        self.lib = lib
        self.threads = check_threads(threads)
        self._backend = lib.backend_cpu_init()
        if not self._backend:
            raise GgmlUnavailable("ggml_backend_cpu_init failed")
        self._ctx = None
        self._ctx_bytes = 0
        self.lock = threading.Lock()
        #: kept graphs (:meth:`graph`): key -> Graph, least recently used first
        self.graph_cache_bytes = graph_cache_bytes
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # keys built once, newest last
        self._graph_bytes = 0
        self._calls = 0
        self.graph_stats = {"reused": 0, "built": 0, "kept": 0, "dropped": 0}

    def context(self, nbytes: int, n_tensors: int):
        """A fresh (reset) compute context with room for ``nbytes`` of data in ``n_tensors``."""
        lib = self.lib
        need = self._context_bytes(nbytes, n_tensors)
        if self._ctx is not None and self._ctx_bytes >= need:
            lib.reset(self._ctx)
            return self._ctx
        self._free_ctx()
        size = max(need, 1 << 20)
        ctx = lib.init(_InitParams(size, None, False))
        if not ctx:
            raise MemoryError(f"ggml could not allocate a {size >> 20} MB compute context")
        self._ctx, self._ctx_bytes = ctx, size
        return ctx

    def _context_bytes(self, nbytes: int, n_tensors: int) -> int:
        lib = self.lib
        need = nbytes + n_tensors * (lib.tensor_overhead_bytes + 64) + (1 << 12)
        return need + int(lib.graph_overhead_custom(self.graph_size(n_tensors), False))

    @staticmethod
    def graph_size(n_tensors: int) -> int:
        return max(16, 2 * n_tensors)

    def graph(self, key, nbytes: int, n_tensors: int, build, *, meta_tensors: int = 0) -> "Graph":
        """A built graph for ``key``: the kept one if this key was built before, else ``build(g)``'s.

        Why: a decode step has the same shapes every step (the same sequences, one row each), so
        its graphs are built once and run again with new input data, instead of being made again
        node by node through ctypes every step (for a 48-layer model with 16 sequences, ~45 ms of
        Python per step). ``key`` must name everything the graph's structure depends on: the
        layer, the row counts, and the address and size of any outside memory its tensors are
        placed on (a sequence's state or KV cache), so that a key that matches again describes
        memory that is live and laid out the same; input *values* (rows, positions, masks, ids)
        are not part of it. None: never keep (build in the reset scratch context, as before).

        ``build(g)`` makes the tensors in ``g.ctx`` (allocated) and ``g.meta`` (metadata only,
        ``meta_tensors`` of them, for tensors placed on outside memory with :meth:`Graph.wrap`),
        adds the outputs to ``g.graph``, and returns what the caller needs (kept as ``g.t``). A
        graph is kept on its key's second build (a one-off shape, a prompt's length, is never
        kept: it would only hold memory), when the cache has room (``graph_cache_bytes``, graphs
        up to ``GRAPH_ENTRY_BYTES``): the least recently used graph not used for ``STALE_CALLS``
        calls makes room, a graph still in use never does; what is not kept is built per call in
        the scratch context. A kept graph computes the same bits as a fresh one: same ops, same
        shapes, same thread count. Call :meth:`release` after reading the outputs. Hold
        ``self.lock``."""
        self._calls += 1
        g = self._graphs.get(key) if key is not None else None
        if g is not None:
            self._graphs.move_to_end(key)
            g.used = self._calls
            self.graph_stats["reused"] += 1
            return g
        lib = self.lib
        need = self._context_bytes(nbytes, n_tensors)
        meta_bytes = meta_tensors * (lib.tensor_overhead_bytes + 16) + 1024 if meta_tensors else 0
        keep = False
        if key is not None and self.graph_cache_bytes:
            if key in self._seen:  # its second build: the shape recurs
                keep = need + meta_bytes <= self.GRAPH_ENTRY_BYTES and self._make_room(need + meta_bytes)
            else:
                self._seen[key] = None
                if len(self._seen) > self.SEEN_KEYS:
                    self._seen.popitem(last=False)
        if keep:
            ctx = lib.init(_InitParams(need, None, False))
            if not ctx:
                raise MemoryError(f"ggml could not allocate a {need >> 20} MB graph context")
        else:
            ctx = self.context(nbytes, n_tensors)
        g = Graph(lib, ctx, kept=keep, nbytes=need + meta_bytes)
        try:
            if meta_tensors:
                g.meta = lib.init(_InitParams(meta_bytes, None, True))
                if not g.meta:
                    raise MemoryError("ggml_init failed")
            g.graph = lib.new_graph_custom(ctx, self.graph_size(n_tensors), False)
            g.t = build(g)
        except BaseException:
            g.close(free_ctx=keep)
            raise
        self.graph_stats["built"] += 1
        if keep:
            g.used = self._calls
            self._graphs[key] = g
            self._graph_bytes += g.nbytes
            self.graph_stats["kept"] += 1
        return g

    def run_one(self, key, nbytes: int, n_tensors: int, build, x: np.ndarray, macs: int) -> np.ndarray:
        """A graph of one input and one output (``build(g)`` returns numpy views of both): ``x`` in,
        computed, a copy of the output back. Takes ``self.lock``."""
        with self.lock:
            g = self.graph(key, nbytes, n_tensors, build)
            try:
                x_in, y = g.t
                x_in[...] = x
                self.compute(g.graph, macs)
                return y.copy()
            finally:
                self.release(g)

    def release(self, g: "Graph") -> None:
        """After a :meth:`graph`'s outputs are read: a graph built per call frees its metadata and
        wrapped buffers (a kept one keeps them for the next step)."""
        if not g.kept:
            g.close(free_ctx=False)
            self.done()

    def _make_room(self, nbytes: int) -> bool:
        if self._graph_bytes + nbytes <= self.graph_cache_bytes:
            return True
        for key in list(self._graphs):  # least recently used first
            g = self._graphs[key]
            if self._calls - g.used < self.STALE_CALLS:
                break  # in use: what follows in the order is newer still
            self._drop(key)
            if self._graph_bytes + nbytes <= self.graph_cache_bytes:
                return True
        return False

    def _drop(self, key) -> None:
        g = self._graphs.pop(key)
        self._graph_bytes -= g.nbytes
        self.graph_stats["dropped"] += 1
        g.close(free_ctx=True)

    def forget_graphs(self) -> None:
        """Drop every kept graph (their memory too). Hold ``self.lock``."""
        for key in list(self._graphs):
            self._drop(key)
        self._seen.clear()

    def compute(self, graph, macs: int) -> None:
        n = max(1, min(self.threads, macs // MIN_MACS_PER_THREAD))
        self.lib.backend_cpu_set_n_threads(self._backend, n)
        status = self.lib.backend_graph_compute(self._backend, graph)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")

    def done(self) -> None:
        if self._ctx_bytes > self.KEEP_BYTES:
            self._free_ctx()

    def _free_ctx(self) -> None:
        if self._ctx is not None:
            self.lib.free(self._ctx)
            self._ctx, self._ctx_bytes = None, 0

    def close(self) -> None:
        with self.lock:
            self.forget_graphs()
            self._free_ctx()
            if self._backend:
                self.lib.backend_free(self._backend)
                self._backend = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Graph:
    """A graph built by :meth:`GgmlRunner.graph` and what it needs to run again: its context (the
    activations, inputs and outputs), a metadata-only context for tensors placed on outside
    memory, the CPU buffers wrapping that memory, and arrays it must keep alive (``keep``)."""

    __slots__ = ("lib", "ctx", "meta", "graph", "t", "buffers", "keep", "kept", "nbytes", "used")

    def __init__(self, lib: GgmlLib, ctx, *, kept: bool, nbytes: int):
        self.lib = lib
        self.ctx = ctx
        self.meta = None
        self.graph = None
        self.t = None
        self.buffers: list = []
        self.keep: list = []
        self.kept = kept
        self.nbytes = nbytes
        self.used = 0

    def wrap(self, arr: np.ndarray):
        """A CPU buffer on ``arr``'s memory (aligned C-contiguous float32), freed with the graph."""
        if arr.dtype != np.float32 or not arr.flags.c_contiguous or arr.ctypes.data % TENSOR_ALIGNMENT:
            raise ValueError("memory for ggml tensors must be aligned C-contiguous float32")
        buf = self.lib.backend_cpu_buffer_from_ptr(arr.ctypes.data, arr.nbytes)
        if not buf:
            raise MemoryError("ggml could not wrap an array")
        self.buffers.append(buf)
        return buf

    def place(self, buf, tensor, addr: int) -> None:
        """Put metadata tensor ``tensor`` at ``addr`` inside wrapped buffer ``buf``."""
        place_tensor(self.lib, buf, tensor, addr)

    def close(self, *, free_ctx: bool) -> None:
        lib = self.lib
        if self.meta:
            lib.free(self.meta)
            self.meta = None
        for b in self.buffers:
            lib.backend_buffer_free(b)
        self.buffers = []
        self.keep = []
        if free_ctx and self.ctx:
            lib.free(self.ctx)
        self.ctx = None


def place_tensor(lib: GgmlLib, buffer, tensor, addr: int) -> None:
    """Put a metadata-only tensor at ``addr`` inside ``buffer`` (a CPU buffer wrapping outside memory)."""
    status = lib.backend_tensor_alloc(buffer, tensor, addr)
    if status != 0:
        raise RuntimeError(f"ggml_backend_tensor_alloc failed ({status})")


def f32_view(lib: GgmlLib, tensor, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of an F32 ggml tensor's data (valid until its context is reset)."""
    n = 1
    for d in shape:
        n *= d
    buf = (ctypes.c_char * (4 * n)).from_address(lib.get_data(tensor))
    return np.frombuffer(buf, dtype=np.float32).reshape(shape)


def _i32_view(lib: GgmlLib, tensor, n: int) -> np.ndarray:
    """A numpy view of an I32 ggml tensor's n values."""
    return np.ctypeslib.as_array(ctypes.cast(lib.get_data(tensor), ctypes.POINTER(ctypes.c_int32)), shape=(n,))


# ---- weights that are views of the memory map ---------------------------------------------------
class MappedWeights:
    """ggml tensors whose data are byte ranges of one memory-mapped file (no copy, ever).

    Tensor metadata lives in no-alloc contexts of ``CHUNK`` tensors each, created as needed, so a
    backbone holding every expert of a big model pays only for the experts it has touched.
    """

    CHUNK = 1024

    def __init__(self, lib: GgmlLib, mapping: np.ndarray, name: str):
        if not isinstance(mapping, np.ndarray) or mapping.dtype != np.uint8 or mapping.ndim != 1:
            raise TypeError("mapping must be the uint8 memory map of a file")
        self.lib = lib
        self.name = name
        self._mapping = mapping  # keeps the map alive as long as these tensors are
        self.base = mapping.ctypes.data
        self.size = mapping.nbytes
        if self.base % TENSOR_ALIGNMENT:
            raise GgmlUnavailable(f"{name}: memory map is not {TENSOR_ALIGNMENT}-byte aligned")
        self._buffer = lib.backend_cpu_buffer_from_ptr(self.base, self.size)
        if not self._buffer:
            raise GgmlUnavailable(f"{name}: ggml could not wrap the memory map")
        self._ctxs: list = []
        self._left = 0

    def tensor(self, ggml_type: int, ne0: int, ne1: int, offset: int, what: str, ne2: int = 1):
        """A ggml tensor (ne0 columns, ne1 rows; ``ne2`` matrices of them, e.g. one per expert, when
        above 1) of ``ggml_type`` at byte ``offset`` of the file."""
        lib = self.lib
        if ggml_type not in WEIGHT_TYPES:
            raise ModelFormatError(f"{self.name}: {what}: ggml kernel does not take weight type {ggml_type}")
        blck = int(lib.blck_size(ggml_type))
        if ne0 <= 0 or ne1 <= 0 or ne0 % blck:
            raise ModelFormatError(f"{self.name}: {what}: row length {ne0} is not a multiple of the "
                                   f"{WEIGHT_TYPES[ggml_type]} block size {blck}")
        if ne2 <= 0:
            raise ModelFormatError(f"{self.name}: {what}: {ne2} matrices")
        nbytes = int(lib.row_size(ggml_type, ne0)) * ne1 * ne2
        if offset < 0 or offset + nbytes > self.size:
            raise ModelFormatError(f"{self.name}: {what}: bytes {offset}..{offset + nbytes} outside the file")
        if offset % TENSOR_ALIGNMENT:
            raise ModelFormatError(f"{self.name}: {what}: data at offset {offset} is not "
                                   f"{TENSOR_ALIGNMENT}-byte aligned")
        if self._left == 0:
            ctx = lib.init(_InitParams(self.CHUNK * (lib.tensor_overhead_bytes + 16), None, True))
            if not ctx:
                raise MemoryError("ggml_init failed")
            self._ctxs.append(ctx)
            self._left = self.CHUNK
        t = (lib.new_tensor_2d(self._ctxs[-1], ggml_type, ne0, ne1) if ne2 == 1
             else lib.new_tensor_3d(self._ctxs[-1], ggml_type, ne0, ne1, ne2))
        self._left -= 1
        if int(lib.nbytes(t)) != nbytes:
            raise ModelFormatError(f"{self.name}: {what}: ggml sizes it at {lib.nbytes(t)} bytes, expected {nbytes}")
        status = lib.backend_tensor_alloc(self._buffer, t, self.base + offset)
        if status != 0:
            raise RuntimeError(f"{self.name}: {what}: ggml_backend_tensor_alloc failed ({status})")
        return t

    def close(self) -> None:
        for ctx in self._ctxs:
            self.lib.free(ctx)
        self._ctxs = []
        if self._buffer:
            self.lib.backend_buffer_free(self._buffer)
            self._buffer = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux >= 5.14


def populate(mapping: np.ndarray) -> bool:
    """Map every page of a file mapping into this process now, as llama.cpp's loader does
    (``MAP_POPULATE``); True if the kernel did (``MADV_POPULATE_READ``), False if it could only be
    asked to read ahead (``MADV_WILLNEED``, older kernels) or this is not Linux.

    Why: a page of the memory map costs a page fault the first time this process touches it (on a
    VM several microseconds), and a decode step touches the ~16 experts it routes to, 5.3 MB each at
    the 122B's geometry: measured here, ~45 MB of new pages per step for the first steps of a fresh
    backbone. The backbone holds every expert as the fallback replica anyway, so it maps them once,
    at start-up, like llama.cpp. Resident memory then shows the whole file (file pages: the kernel
    can still drop them under memory pressure and read them back)."""
    if not sys.platform.startswith("linux") or mapping.nbytes == 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False
    madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    start = mapping.ctypes.data // page * page
    length = mapping.ctypes.data + mapping.nbytes - start
    if madvise(start, length, MADV_POPULATE_READ) == 0:
        return True
    madvise(start, length, MADV_WILLNEED)
    return False


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


# The expert bank and the dense path live in their own modules (ggml_experts, ggml_dense); their
# names are still reachable here (``ggml_kernel.GgmlExpertBank`` etc.), loaded on first use, so
# callers written before the split keep working and the modules never import each other in a cycle.
_MOVED = {"GgmlExpertBank": "ggml_experts", "QuantisedMatrix": "ggml_dense", "GgmlDense": "ggml_dense",
          "fused_matmuls": "ggml_dense", "fused_swiglu": "ggml_dense"}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # on first use only

    return getattr(importlib.import_module(f"p2pswarm.engine.{module}"), name)
