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
                10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
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
    scratch memory forever.
    """

    KEEP_BYTES = 64 << 20

    def __init__(self, lib: GgmlLib, threads: int | None = None):
        self.lib = lib
        self.threads = check_threads(threads)
        self._backend = lib.backend_cpu_init()
        if not self._backend:
            raise GgmlUnavailable("ggml_backend_cpu_init failed")
        self._ctx = None
        self._ctx_bytes = 0
        self.lock = threading.Lock()

    def context(self, nbytes: int, n_tensors: int):
        """A fresh (reset) compute context with room for ``nbytes`` of data in ``n_tensors``."""
        lib = self.lib
        need = nbytes + n_tensors * (lib.tensor_overhead_bytes + 64) + (1 << 12)
        need += int(lib.graph_overhead_custom(self.graph_size(n_tensors), False))
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

    @staticmethod
    def graph_size(n_tensors: int) -> int:
        return max(16, 2 * n_tensors)

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
            self._free_ctx()
            if self._backend:
                self.lib.backend_free(self._backend)
                self._backend = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


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


# ---- the expert bank ------------------------------------------------------------------------------
class GgmlExpertBank:
    """Routed experts of some layers and an expert range, computed by ggml on the mapped bytes.

    Implements :class:`p2pswarm.contracts.ExpertBank` (``forward``, ``forward_groups``,
    ``holds``, ``kernel``), like the numpy and portable banks, so the worker, the dispatcher and the backbone's
    fallback replica use either without knowing which. ``cache`` is None: nothing is dequantised.
    """

    cache = None

    def __init__(self, layout, *, threads: int | None = None, lib: GgmlLib | None = None):
        self.lib = lib or load_libggml()
        self.kernel = self.lib.kernel_id
        self.layout = layout
        self.layers = frozenset(layout.expert_layers)
        self.expert_begin = layout.expert_begin
        self.expert_end = layout.expert_end
        self.n_embd = int(layout.hparam("embedding_length", required=True))
        self.runner = GgmlRunner(self.lib, threads)
        self.threads = self.runner.threads
        self._mapped = MappedWeights(self.lib, layout.reader.data, str(layout.path))
        self._experts: dict[tuple[int, int], tuple] = {}
        self._layers: dict[int, tuple] = {}
        self._check_types()

    def _check_types(self) -> None:
        for layer, tensors in self.layout.expert_tensors.items():
            for kind, t in tensors.items():
                if kind.endswith("_bias"):
                    continue
                if int(t.ggml_type) not in WEIGHT_TYPES:
                    raise ModelFormatError(f"{t.name}: weight type {t.ggml_type.name} is not supported by the "
                                           "ggml kernel")
                rows, cols = t.shape[1], t.shape[2]
                if int(self.lib.row_size(int(t.ggml_type), cols)) * rows != t.expert_nbytes:
                    raise ModelFormatError(f"{t.name}: {t.expert_nbytes} bytes per expert do not match "
                                           f"{t.ggml_type.name} {rows}x{cols}")

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self.layers and self.expert_begin <= expert < self.expert_end

    def _tensors(self, layer: int, expert: int) -> tuple:
        """(gate, up, down, n_ff, macs per row) ggml tensors of one expert; made once, no copy."""
        key = (layer, expert)
        got = self._experts.get(key)
        if got is not None:
            return got
        if not self.holds(layer, expert):
            raise UserError(
                f"expert {expert} of layer {layer} is not held here "
                f"(layers {sorted(self.layers)}, experts {self.expert_begin}-{self.expert_end - 1})"
            )
        tensors = self.layout.expert_tensors[layer]
        local = expert - self.expert_begin
        m = self._mapped

        def make(kind: str, row0: int = 0, rows: int | None = None):
            t = tensors[kind]
            off, _ = t.slab(local)
            n_rows, n_cols = t.shape[1], t.shape[2]
            rows = n_rows if rows is None else rows
            row_bytes = int(self.lib.row_size(int(t.ggml_type), n_cols))
            return m.tensor(int(t.ggml_type), n_cols, rows, off + row0 * row_bytes, f"{t.name}[{expert}]")

        if "gate_up" in tensors:
            ff = tensors["gate_up"].shape[1] // 2
            gate, up = make("gate_up", 0, ff), make("gate_up", ff, ff)
        else:
            ff = tensors["gate"].shape[1]
            gate, up = make("gate"), make("up")
        down = make("down")
        got = (gate, up, down, ff, 3 * ff * self.n_embd)
        self._experts[key] = got
        return got

    def forward(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * (up x)) for rows (n, n_embd) float32 -> (n, n_embd) float32."""
        rows = np.asarray(rows, dtype=np.float32)
        return self.forward_groups(layer, rows, [(expert, np.arange(rows.shape[0]))])[0]

    def _layer(self, layer: int) -> tuple:
        """(gate, up, down, ff) 3-D ggml tensors over every expert of ``layer`` held here (ne2 = the
        local expert index, as llama.cpp's ``ffn_*_exps``): what ``ggml_mul_mat_id`` selects from.
        Made once per layer, no copy; a fused gate_up is split into two strided views at graph time."""
        got = self._layers.get(layer)
        if got is not None:
            return got
        tensors = self.layout.expert_tensors[layer]
        m = self._mapped

        def make(kind: str):
            t = tensors[kind]
            off, _ = t.slab(0)
            return m.tensor(int(t.ggml_type), t.shape[2], t.shape[1], off, f"{t.name}[{self.expert_begin}:]",
                            ne2=t.n_expert)

        if "gate_up" in tensors:
            t = tensors["gate_up"]
            ff = t.shape[1] // 2
            row_bytes = int(self.lib.row_size(int(t.ggml_type), t.shape[2]))
            fused = make("gate_up")
            # (tensor, columns, rows, experts, bytes per row, bytes per expert, byte offset of row 0):
            # viewed in each compute context (a view is a node of the graph that reads it)
            gate = (fused, t.shape[2], ff, t.n_expert, row_bytes, t.expert_nbytes, 0)
            up = (fused, t.shape[2], ff, t.n_expert, row_bytes, t.expert_nbytes, ff * row_bytes)
        else:
            ff = tensors["gate"].shape[1]
            gate, up = make("gate"), make("up")
        got = (gate, up, make("down"), ff)
        self._layers[layer] = got
        return got

    def forward_groups(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """Every (expert, row indices) group of one layer: rows[idx] through that expert, in order.

        One ggml graph, one ``ggml_mul_mat_id`` per projection for all groups (llama.cpp's
        ``build_moe_ffn``): each (group, row) pair is one column of the batch with its local expert
        id, so an expert's weights are streamed once per call however many groups share a request.

        Why this is exact for split == monolithic: inside mul_mat_id every output element is one
        dot product of a weight row with the row's own quantised activations, and the kernel is
        chosen per expert from that expert's row count (the tiled GEMM from 8 rows, else vec_dot).
        So a group's result depends only on its expert and its rows, never on the other groups of
        the request nor the thread count; a worker computing the group alone gets the same bits.
        That holds only while each expert appears once per call: two groups of one expert (the
        batch-invariant scheduler sends one per sequence) would add up to another row count and
        maybe another kernel. So the k-th group of each expert goes in the k-th call.
        """
        rows = np.asarray(rows, dtype=np.float32)
        E = self.n_embd
        if rows.ndim != 2 or rows.shape[1] != E:
            raise UserError(f"rows have shape {rows.shape}, expected (n, {E})")
        if not groups:
            return []
        for e, _ in groups:
            if not self.holds(layer, e):
                raise UserError(
                    f"expert {e} of layer {layer} is not held here "
                    f"(layers {sorted(self.layers)}, experts {self.expert_begin}-{self.expert_end - 1})"
                )
        idxs = [np.asarray(idx, dtype=np.int64).reshape(-1) for _, idx in groups]
        if any(len(i) and (i.min() < 0 or i.max() >= rows.shape[0]) for i in idxs):
            raise UserError(f"row index out of range 0..{rows.shape[0] - 1}")
        seen: dict[int, int] = {}
        rounds: list[list[int]] = []  # group positions per call: each expert at most once in a call
        for k, (e, _) in enumerate(groups):
            r = seen.get(e, 0)
            seen[e] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(k)
        result: list[np.ndarray | None] = [None] * len(groups)
        for ks in rounds:
            for k, out in zip(ks, self._forward_once(layer, rows, [groups[k][0] for k in ks], [idxs[k] for k in ks])):
                result[k] = out
        return result

    def _forward_once(self, layer: int, rows: np.ndarray, experts: list[int], idxs: list[np.ndarray]) -> list[np.ndarray]:
        """One graph: every (expert, rows) pair through its expert, each expert at most once."""
        E = self.n_embd
        sizes = [len(i) for i in idxs]
        P = sum(sizes)
        if P == 0:
            return [np.zeros((0, E), np.float32) for _ in experts]
        lib = self.lib
        with self.runner.lock:
            gate, up, down, ff = self._layer(layer)
            ctx = self.runner.context(4 * P * (2 * E + 3 * ff + 1) + 8 * 64, 10)
            graph = lib.new_graph_custom(ctx, self.runner.graph_size(10), False)
            x = lib.new_tensor_3d(ctx, GGML_TYPE_F32, E, 1, P)
            np.take(rows, np.concatenate(idxs), axis=0, out=f32_view(lib, x, (P, E)))
            ids = lib.new_tensor_2d(ctx, GGML_TYPE_I32, 1, P)
            local = np.repeat(np.array([e - self.expert_begin for e in experts], np.int32), sizes)
            _i32_view(lib, ids, P)[...] = local
            if isinstance(gate, tuple):  # fused gate_up: two strided views of one tensor
                g_w, u_w = (lib.view_3d(ctx, *view) for view in (gate, up))
            else:
                g_w, u_w = gate, up
            h = lib.swiglu_split(ctx, lib.mul_mat_id(ctx, g_w, x, ids), lib.mul_mat_id(ctx, u_w, x, ids))
            out = lib.mul_mat_id(ctx, down, h, ids)  # (E, 1, P)
            lib.build_forward_expand(graph, out)
            self.runner.compute(graph, P * 3 * ff * E)
            flat = f32_view(lib, out, (P, E))
            result, at = [], 0
            for n in sizes:
                result.append(flat[at:at + n].copy())
                at += n
            self.runner.done()
        return result

    def close(self) -> None:
        self.runner.close()
        self._experts.clear()
        self._layers.clear()
        self._mapped.close()


# ---- the dense path on quantised weights ---------------------------------------------------------
class QuantisedMatrix:
    """A quantised 2-D weight W (out, in) in numpy's orientation, left in the memory map.

    The dense path writes ``ops.matmul(x, W)``, i.e. ``x @ W.T``, and ``W[token_ids]`` for the
    embedding. Both are intercepted here and run by ggml on the quantised bytes (``mul_mat`` and
    ``get_rows``, llama.cpp's ops). Anything else numpy asks of it (``np.asarray``, a ufunc, an
    attribute such as ``reshape``) falls back to a float32 dequantised copy, made once, so code
    written for plain arrays still works; it just does not save the memory.
    """

    def __init__(self, runner: GgmlRunner, tensor, ggml_type: int, shape: tuple[int, int], name: str,
                 dequantise):
        self.runner = runner
        self.tensor = tensor
        self.ggml_type = ggml_type
        self.shape = shape
        self.ndim = 2
        self.dtype = np.dtype(np.float32)
        self.name = name
        self._dequantise = dequantise
        self._dense: np.ndarray | None = None

    # numpy protocol -----------------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        if self._dense is None:
            self._dense = self._dequantise()
        return self._dense if dtype is None else self._dense.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # Only ``x @ W.T`` is ggml's (see _Transposed); any other ufunc sees the dequantised array.
        inputs = tuple(np.asarray(i) if isinstance(i, (QuantisedMatrix, _Transposed)) else i for i in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(np.asarray(self), name)

    @property
    def T(self) -> "_Transposed":
        return _Transposed(self)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        ids = np.asarray(key)
        if ids.dtype.kind in "iu" and ids.ndim == 1:
            return self.get_rows(ids)
        return np.asarray(self)[key]

    # the two ops ---------------------------------------------------------------------------------
    def rmatmul_t(self, x: np.ndarray) -> np.ndarray:
        """x @ W.T for x (..., in) float32 -> (..., out) float32, by ggml_mul_mat(W, x)."""
        x = np.asarray(x, dtype=np.float32)
        out_n, in_n = self.shape
        if x.shape[-1] != in_n:
            raise ValueError(f"matmul: {x.shape} @ {self.name}.T of shape ({in_n}, {out_n})")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_n)
        n = x2.shape[0]
        if n == 0:
            return np.zeros((*lead, out_n), np.float32)
        lib, r = self.runner.lib, self.runner
        with r.lock:
            ctx = r.context(4 * n * (in_n + out_n) + 256, 3)
            graph = lib.new_graph_custom(ctx, r.graph_size(3), False)
            xt = lib.new_tensor_2d(ctx, GGML_TYPE_F32, in_n, n)
            f32_view(lib, xt, (n, in_n))[...] = x2
            out = lib.mul_mat(ctx, self.tensor, xt)
            lib.build_forward_expand(graph, out)
            r.compute(graph, n * in_n * out_n)
            result = f32_view(lib, out, (n, out_n)).copy()
            r.done()
        return result.reshape(*lead, out_n)

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """W[ids] dequantised by ggml_get_rows (llama.cpp's embedding lookup)."""
        ids = np.asarray(ids)
        out_n, in_n = self.shape
        if ids.size and (ids.min() < 0 or ids.max() >= out_n):
            raise IndexError(f"{self.name}: row index out of range 0..{out_n - 1}")
        n = int(ids.size)
        if n == 0:
            return np.zeros((0, in_n), np.float32)
        lib, r = self.runner.lib, self.runner
        with r.lock:
            ctx = r.context(4 * n * (in_n + 1) + 256, 3)
            graph = lib.new_graph_custom(ctx, r.graph_size(3), False)
            it = lib.new_tensor_1d(ctx, GGML_TYPE_I32, n)
            np.ctypeslib.as_array(ctypes.cast(lib.get_data(it), ctypes.POINTER(ctypes.c_int32)), shape=(n,))[...] = ids
            out = lib.get_rows(ctx, self.tensor, it)
            lib.build_forward_expand(graph, out)
            r.compute(graph, 0)
            result = f32_view(lib, out, (n, in_n)).copy()
            r.done()
        return result


def _dense_graph(x: np.ndarray, mats: list[QuantisedMatrix], swiglu: bool) -> list[np.ndarray]:
    """One ggml graph on one input: ``x @ W.T`` for every W (``swiglu`` False), or the whole
    ``down(silu(gate x) * (up x))`` of a dense FFN (``swiglu`` True, mats = gate, up, down).

    Why one graph: each graph run wakes the thread team and ends in barriers; a DeltaNet layer's
    four input projections (or attention's q/k/v) read the same rows, so they go in together.
    Every ``mul_mat`` in it is the same op it would be alone (same kernel, same per-row rounding),
    so fusing changes no bits of the projections."""
    r = mats[0].runner
    lib = r.lib
    in_n = mats[0].shape[1]
    if any(m.runner is not r or m.shape[1] != (in_n if not swiglu or i < 2 else mats[0].shape[0])
           for i, m in enumerate(mats)):
        raise ValueError("fused mat-muls need weights of one runner and one input width")
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] != in_n:
        raise ValueError(f"matmul: {x.shape} @ {mats[0].name}.T of shape ({in_n}, {mats[0].shape[0]})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_n)
    n = x2.shape[0]
    out_ns = [mats[2].shape[0]] if swiglu else [m.shape[0] for m in mats]
    if n == 0:
        return [np.zeros((*lead, o), np.float32) for o in out_ns]
    inner = 3 * mats[0].shape[0] if swiglu else 0
    macs = n * sum(m.shape[0] * m.shape[1] for m in mats)
    with r.lock:
        ctx = r.context(4 * n * (in_n + inner + sum(out_ns)) + 64 * (len(mats) + 4), len(mats) + 4)
        graph = lib.new_graph_custom(ctx, r.graph_size(len(mats) + 4), False)
        xt = lib.new_tensor_2d(ctx, GGML_TYPE_F32, in_n, n)
        f32_view(lib, xt, (n, in_n))[...] = x2
        if swiglu:
            g, u, d = (m.tensor for m in mats)
            outs = [lib.mul_mat(ctx, d, lib.swiglu_split(ctx, lib.mul_mat(ctx, g, xt), lib.mul_mat(ctx, u, xt)))]
        else:
            outs = [lib.mul_mat(ctx, m.tensor, xt) for m in mats]
        for o in outs:
            lib.build_forward_expand(graph, o)
        r.compute(graph, macs)
        result = [f32_view(lib, o, (n, on)).reshape(*lead, on).copy() for o, on in zip(outs, out_ns)]
        r.done()
    return result


def fused_matmuls(x: np.ndarray, mats: list) -> list[np.ndarray] | None:
    """``[x @ W.T for W in mats]`` in one ggml graph when every W is a :class:`QuantisedMatrix` of
    one runner; None otherwise (the caller multiplies them one by one)."""
    if len(mats) < 2 or not all(isinstance(m, QuantisedMatrix) and m.runner is mats[0].runner for m in mats):
        return None
    return _dense_graph(x, list(mats), swiglu=False)


def fused_swiglu(x: np.ndarray, gate, up, down) -> np.ndarray | None:
    """A dense SwiGLU FFN (the shared expert) in one ggml graph, with ggml's SwiGLU as llama.cpp
    computes it; None unless all three weights are :class:`QuantisedMatrix` of one runner."""
    mats = [gate, up, down]
    if not all(isinstance(m, QuantisedMatrix) and m.runner is gate.runner for m in mats):
        return None
    return _dense_graph(x, mats, swiglu=True)[0]


class _Transposed:
    """``W.T`` of a :class:`QuantisedMatrix`: what ``x @ W.T`` hands numpy."""

    __array_priority__ = 100

    def __init__(self, m: QuantisedMatrix):
        self.m = m
        self.shape = (m.shape[1], m.shape[0])
        self.ndim = 2

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.m, dtype=dtype).T

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul and method == "__call__" and not kwargs and len(inputs) == 2 and inputs[1] is self:
            return self.m.rmatmul_t(inputs[0])
        inputs = tuple(np.asarray(i) if isinstance(i, (QuantisedMatrix, _Transposed)) else i for i in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __rmatmul__(self, x):
        return self.m.rmatmul_t(x)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(np.asarray(self), name)


class GgmlDense:
    """The quantised 2-D tensors of a model's dense path as :class:`QuantisedMatrix` objects."""

    def __init__(self, layout, *, threads: int | None = None, lib: GgmlLib | None = None):
        from p2pswarm.engine.weights import to_float32  # noqa: PLC0415 - engine-internal, avoids a cycle

        self.lib = lib or load_libggml()
        self.kernel = self.lib.kernel_id
        self.layout = layout
        self.runner = GgmlRunner(self.lib, threads)
        self._mapped = MappedWeights(self.lib, layout.reader.data, str(layout.path))
        self._to_float32 = to_float32

    def eligible(self, t) -> bool:
        """Quantised 2-D tensors that are not routed experts (those are the expert bank's)."""
        return (int(t.tensor_type) in QUANTISED_TYPES and len(t.shape) == 2
                and "_exps." not in t.name)

    def matrix(self, t) -> QuantisedMatrix:
        ne0, ne1 = int(t.shape[0]), int(t.shape[1])
        gtype = int(t.tensor_type)
        tensor = self._mapped.tensor(gtype, ne0, ne1, int(t.data_offset), t.name)
        raw = t.data

        def dequantise():
            return self._to_float32(raw.reshape(-1) if raw.ndim else raw, t.tensor_type, (ne1, ne0), t.name)

        return QuantisedMatrix(self.runner, tensor, gtype, (ne1, ne0), t.name, dequantise)


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
