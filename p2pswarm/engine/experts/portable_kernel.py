"""The portable expert kernel: down(silu(gate x) * (up x)) with the same bits on every ISA.

Why: ggml's kernels sum in an order chosen by their SIMD code (AVX2, AVX-512, NEON), so an aarch64
phone and an x86-64 backbone both running ggml disagree in the last bits, and a bit-exact swarm has
to refuse the phone. This kernel defines every result as integer arithmetic (exact in any order)
plus one fixed sequence of float32 operations, each IEEE-rounded on its own, so any machine with
IEEE float32/float64 computes the same bits (docs/kernels.md, "The portable kernel"):

* activations are quantised to int8 blocks by ggml's reference ``quantize_row_q8_K`` formula
  (blocks of 256 for Q4_K/Q6_K, of 32 for Q8_0; the scale stays float32);
* a block's dot product is an integer (weights unpacked to unsigned bytes: u8 x s8 -> int32),
  scaled in float32: ``(d_w * d_a) * float(sumi) - (dmin_w * d_a) * float(summ)`` for Q4_K;
* a row's result is its blocks' results added in block order;
* F32/F16 weights: 8 float32 lanes along the row, combined ((0+1)+(2+3))+((4+5)+(6+7));
* silu(g) = g / (1 + exp(-g)) with our own double-precision exp (libm's differs between libcs).

Two implementations of that one definition: a small C file (``portable_kernel.c``, built with
``-ffp-contract=off``, never ``-ffast-math``) and numpy (this module, :class:`NumpyOps`). The C one
is built on first use with the system C compiler (``$CC``, else ``cc``) into
``~/.cache/p2pswarm/portable/`` (or loaded from ``$P2PSWARM_PORTABLE_LIB``, e.g. a cross-compiled
aarch64 build); without a compiler the numpy one runs (slower, same bits: tested).

Weights are read in place: the C code gets pointers into the memory map, numpy gets views of it.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from p2pswarm import settings
from p2pswarm.engine.experts.numpy_bank import check_held
from p2pswarm.errors import ModelFormatError, UserError

log = logging.getLogger("p2pswarm.engine")

VERSION = 1  # bump when any result could change; it is the kernel family's name
FAMILY = f"portable-{VERSION}"
C_SOURCE = Path(__file__).with_name("portable_kernel.c")
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")
ENV_LIB = settings.PORTABLE_LIB.name  # a prebuilt .so (e.g. cross-compiled for a phone)
ENV_NATIVE = settings.PORTABLE_NATIVE.name  # "off": use the numpy implementation
ENV_CC = "CC"

F32, F16, Q8_0, Q4_K, Q6_K = 0, 1, 8, 12, 14
TYPES = {F32: "F32", F16: "F16", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
ACT_BLOCK = {Q8_0: 32, Q4_K: 256, Q6_K: 256}  # activation block of each quantised weight type
WEIGHT_BLOCK = {F32: (8, 32), F16: (8, 16), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


def kernel_id() -> str:
    """What a portable node puts in the handshake: the family, then (for display only) its ISA."""
    return f"{FAMILY}/{platform.machine()}"


def refusal(layout) -> str | None:
    """Why the portable kernel cannot compute ``layout``'s experts, or None when it can.

    gpt-oss experts are refused: their clamped SwiGLU (``swiglu_oai``: a sigmoid of 1.702 x) and
    per-expert biases are not in this kernel's fixed-order integer arithmetic, and neither are
    their MXFP4 weights (E8M0 scales, E2M1 codes); computing them some other way here would give
    other bits than a portable peer on another ISA, which is the one thing this kernel promises.
    A gpt-oss worker therefore answers only in its own kernel's family (see
    :class:`p2pswarm.worker.expert_worker.ExpertWorker`)."""
    from p2pswarm.engine.experts.expert_fn import SWIGLU, activation

    if activation(layout) != SWIGLU:
        return (f"the portable kernel does not compute {layout.arch} experts (swiglu_oai, expert biases, "
                "MXFP4 weights are not in its bit-exact arithmetic); use --kernel ggml or numpy")
    return None


def row_bytes(wtype: int, k: int) -> int:
    values, nbytes = WEIGHT_BLOCK[wtype]
    return k // values * nbytes


def check_shape(wtype: int, k: int, what: str) -> None:
    if wtype not in TYPES:
        from gguf import GGMLQuantizationType

        try:
            name = GGMLQuantizationType(wtype).name
        except ValueError:
            name = str(wtype)
        raise ModelFormatError(f"{what}: weight type {name} is not supported by the portable kernel "
                               f"(it takes {', '.join(TYPES.values())})")
    block = ACT_BLOCK.get(wtype, 8)
    if k % block:
        raise ModelFormatError(f"{what}: row length {k} is not a multiple of {block} (portable {TYPES[wtype]})")


# ---- the C implementation -----------------------------------------------------------------------
class NativeOps:
    """portable_kernel.c through ctypes (every call releases the GIL)."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, P = ctypes.c_int64, ctypes.c_void_p
        lib.pk_version.restype, lib.pk_version.argtypes = ctypes.c_int, []
        lib.pk_qsize.restype, lib.pk_qsize.argtypes = i64, [i64, i64, i64]
        lib.pk_quantize.restype, lib.pk_quantize.argtypes = None, [P, i64, i64, i64, P]
        lib.pk_matmul.restype = ctypes.c_int
        lib.pk_matmul.argtypes = [ctypes.c_int, P, i64, i64, i64, P, i64, P, i64]
        lib.pk_swiglu.restype, lib.pk_swiglu.argtypes = None, [P, P, P, i64]
        lib.pk_expert.restype = ctypes.c_int
        lib.pk_expert.argtypes = [ctypes.c_int, P, ctypes.c_int, P, ctypes.c_int, P, i64, i64, P, i64, P]
        if lib.pk_version() != VERSION:
            raise OSError(f"{path} is portable kernel version {lib.pk_version()}, expected {VERSION}")
        lib.pk_simd.restype, lib.pk_simd.argtypes = ctypes.c_char_p, []
        self.simd = lib.pk_simd().decode()  # "avx2", "c" (compiler-vectorised) or "scalar"
        self.lib = lib

    def quantize(self, x: np.ndarray, block: int) -> np.ndarray:
        n, k = x.shape
        buf = np.empty(int(self.lib.pk_qsize(n, k, block)), np.uint8)
        self.lib.pk_quantize(x.ctypes.data, n, k, block, buf.ctypes.data)
        return buf

    def matmul(self, wtype: int, wptr: int, r0: int, r1: int, k: int, act: np.ndarray, n: int,
               out: np.ndarray) -> None:
        if self.lib.pk_matmul(wtype, wptr, r0, r1, k, act.ctypes.data, n, out.ctypes.data, out.shape[1]) != 0:
            raise ModelFormatError(f"portable kernel refused a {TYPES.get(wtype, wtype)} matrix with rows of {k}")

    def expert(self, gate, up, down, base: int, x: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * (up x)) in one C call (``gate``/``up``/``down``: (wtype, offset,
        rows, k) from ``base``): the same steps as quantize/matmul/swiglu one by one, so the same
        bits, without their per-call overhead (a third of a decode call's time in Python)."""
        n, e = x.shape
        out = np.empty((n, e), np.float32)
        if self.lib.pk_expert(gate[0], base + gate[1], up[0], base + up[1], down[0], base + down[1], gate[2], e,
                              x.ctypes.data, n, out.ctypes.data) != 0:
            raise ModelFormatError(f"portable kernel refused an expert of {TYPES.get(gate[0], gate[0])}/"
                                   f"{TYPES.get(down[0], down[0])} matrices {gate[2]}x{e}")
        return out

    def swiglu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        h = np.empty_like(g)
        self.lib.pk_swiglu(g.ctypes.data, u.ctypes.data, h.ctypes.data, g.size)
        return h


_native: NativeOps | None = None
_native_error: str | None = None
_native_lock = threading.Lock()


def load_native() -> NativeOps:
    """The C implementation, built on first use (raises OSError saying why it is unavailable)."""
    global _native, _native_error
    if not settings.PORTABLE_NATIVE.get():
        raise OSError(f"disabled by {ENV_NATIVE}={settings.PORTABLE_NATIVE.raw()}")
    with _native_lock:
        if _native is not None:
            return _native
        if _native_error is not None:
            raise OSError(_native_error)
        try:
            env = settings.PORTABLE_LIB.raw()
            _native = NativeOps(Path(env) if env else build_native())
        except OSError as exc:
            _native_error = str(exc)
            raise
        return _native


def build_native(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile portable_kernel.c for this machine (once per source, compiler and flags; cached).

    ``-march=native`` is safe for the bits: it only widens integer SIMD and vectorises independent
    float lanes; with ``-ffp-contract=off`` no float operation is fused or reordered.
    ``extra_flags`` go after the others (the tests build ``-DPK_SCALAR`` and ``-mno-avx2`` variants
    to check that every variant gives the same bits).
    """
    cc = os.environ.get(ENV_CC) or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc/gcc) to build the portable kernel")
    flags = [*CFLAGS, "-march=native"] if platform.machine() in ("x86_64", "AMD64") else [*CFLAGS, "-mcpu=native"]
    flags += list(extra_flags)
    src = C_SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
    cache = settings.cache_dir("portable", create=False, per_user=True)
    out = cache / f"libp2pswarm_portable-{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp_out = Path(tmp) / out.name
        r = subprocess.run([cc, *flags, str(C_SOURCE), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            flags = [*CFLAGS, *extra_flags]  # a compiler that does not know this CPU: portable code still
            r = subprocess.run([cc, *flags, str(C_SOURCE), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"building the portable kernel failed: {r.stderr.strip()[-300:]}")
        os.replace(tmp_out, out)
    return out


# ---- the numpy implementation (same operations, same order) ---------------------------------------
_MAGIC = np.float32(12582912.0)


class NumpyOps:
    """The definition in numpy: slow (it unpacks whole matrices), bit-identical to the C code."""

    path = None

    @staticmethod
    def quantize(x: np.ndarray, block: int):
        n, k = x.shape
        xb = x.reshape(n, k // block, block)
        idx = np.argmax(np.abs(xb), axis=2)  # first of the largest |x|, as the C loop's strict >
        mx = np.take_along_axis(xb, idx[..., None], axis=2)[..., 0]
        zero = mx == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), mx))
            iscale = iscale.astype(np.float32)
            v = (iscale[..., None] * xb).astype(np.float32)
            t = (v + _MAGIC).astype(np.float32).view(np.int32)
            q = np.minimum((t & 0x007FFFFF) - 0x00400000, 127).astype(np.int8)
            q[zero] = 0
            d = np.where(zero, np.float32(0), np.float32(1.0) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
        q = q.reshape(n, k)
        s16 = q.reshape(n, k // 16, 16).astype(np.int32).sum(axis=2)
        return q, d, s16

    def matmul(self, wtype: int, w: np.ndarray, rows: int, k: int, act, n: int) -> np.ndarray:
        """(n, rows) float32 = act @ W.T for W ``rows`` x ``k`` of ``wtype`` given as uint8 bytes."""
        if wtype in (F32, F16):
            x = act
            W = w.view(np.float32 if wtype == F32 else np.float16).reshape(rows, k).astype(np.float32)
            lane = np.zeros((n, rows, 8), np.float32)
            xr = x.reshape(n, 1, k // 8, 8)
            Wr = W.reshape(1, rows, k // 8, 8)
            for c in range(k // 8):
                lane = lane + xr[:, :, c, :] * Wr[:, :, c, :]
            return ((lane[..., 0] + lane[..., 1]) + (lane[..., 2] + lane[..., 3])) + \
                   ((lane[..., 4] + lane[..., 5]) + (lane[..., 6] + lane[..., 7]))
        q, ad, s16 = act
        block = ACT_BLOCK[wtype]
        nb = k // block
        blocks = w.reshape(rows, nb, WEIGHT_BLOCK[wtype][1])
        a = q.reshape(n, nb, block).astype(np.int32)
        if wtype == Q4_K:
            d, dmin, sc, mn, u = _unpack_q4_k(blocks)
            dots = np.einsum("rbjl,nbjl->nrbj", u.reshape(rows, nb, 8, 32), a.reshape(n, nb, 8, 32))
            sumi = (dots * sc[None]).sum(axis=3)
            s32 = s16.reshape(n, nb, 8, 2).sum(axis=3)
            summ = np.einsum("rbj,nbj->nrb", mn, s32)
            da = ad[:, None, :]
            v = (d[None] * da) * sumi.astype(np.float32)
            m = (dmin[None] * da) * summ.astype(np.float32)
            blockval = v - m
        elif wtype == Q6_K:
            d, sc, u = _unpack_q6_k(blocks)
            dots = np.einsum("rbjl,nbjl->nrbj", u.reshape(rows, nb, 16, 16), a.reshape(n, nb, 16, 16))
            sumi = (sc[None] * (dots - 32 * s16.reshape(n, 1, nb, 16))).sum(axis=3)
            blockval = (d[None] * ad[:, None, :]) * sumi.astype(np.float32)
        else:  # Q8_0
            d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
            u = (blocks[:, :, 2:] ^ 0x80).astype(np.int32)
            dots = np.einsum("rbl,nbl->nrb", u, a)
            sumi = dots - 128 * s16.reshape(n, 1, nb, 2).sum(axis=3)
            blockval = (d[None] * ad[:, None, :]) * sumi.astype(np.float32)
        blockval = blockval.astype(np.float32)
        acc = np.zeros((n, rows), np.float32)
        for b in range(nb):
            acc = acc + blockval[:, :, b]
        return acc

    @staticmethod
    def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        e = _exp64(-(g.astype(np.float64))).astype(np.float32)
        s = g / (np.float32(1.0) + e)
        return (s * u).astype(np.float32)


def _unpack_q4_k(blocks: np.ndarray):
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.empty(blocks.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j] = s[..., j] & 63
            mn[..., j] = s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    q = blocks[..., 16:144].reshape(blocks.shape[:-1] + (4, 32))
    u = np.stack([q & 0xF, q >> 4], axis=-2).reshape(blocks.shape[:-1] + (256,)).astype(np.int32)
    return d, dmin, sc, mn, u


def _unpack_q6_k(blocks: np.ndarray):
    ql = blocks[..., 0:128].astype(np.int32)
    qh = blocks[..., 128:192].astype(np.int32)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.int32)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    halves = []
    for h in range(2):
        L, H = ql[..., 64 * h: 64 * h + 64], qh[..., 32 * h: 32 * h + 32]
        halves += [(L[..., :32] & 0xF) | (((H >> 0) & 3) << 4), (L[..., 32:] & 0xF) | (((H >> 2) & 3) << 4),
                   (L[..., :32] >> 4) | (((H >> 4) & 3) << 4), (L[..., 32:] >> 4) | (((H >> 6) & 3) << 4)]
    return d, sc, np.concatenate(halves, axis=-1)


_EXP_COEF = [1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
             1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0]


def _exp64(y: np.ndarray) -> np.ndarray:
    """pk_exp of the C file, operation for operation, in float64."""
    y = np.clip(y, -104.0, 88.0)
    kf = np.floor(y * 1.4426950408889634 + 0.5)
    r = y - kf * 0.693145751953125
    r = r - kf * 1.4286068203094173e-06
    p = np.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p = p * r + c
    return np.ldexp(p, kf.astype(np.int32))


def ops() -> NativeOps | NumpyOps:
    """The C implementation where it builds/loads, else numpy (one log line saying why)."""
    try:
        return load_native()
    except OSError as exc:
        global _warned
        if not _warned:
            log.warning("portable kernel: C build unavailable (%s); using its numpy implementation", exc)
            _warned = True
        return NumpyOps()


_warned = False


# ---- the expert bank ----------------------------------------------------------------------------
class PortableExpertBank:
    """Routed experts computed by the portable kernel on the mapped bytes (no copy, no cache).

    Implements :class:`p2pswarm.contracts.ExpertBank`. ``threads`` splits each matrix's
    output rows between threads (each output is computed whole by one thread, so the bits do not
    depend on it).
    """

    cache = None
    # Below this many multiply-adds a matrix runs on one thread (thread hand-off costs more).
    min_macs_parallel = 1 << 21

    def __init__(self, layout, *, threads: int | None = None, implementation: str | None = None):
        from p2pswarm.engine.ggml.lib import check_threads  # same rule as ggml's

        why = refusal(layout)
        if why is not None:
            raise ModelFormatError(f"{layout.path}: {why}")
        self.layout = layout
        self.kernel = kernel_id()
        self.layers = frozenset(layout.expert_layers)
        self.expert_begin = layout.expert_begin
        self.expert_end = layout.expert_end
        self.n_embd = int(layout.hparam("embedding_length", required=True))
        self.ops: NativeOps | NumpyOps
        if implementation == "numpy":
            self.ops = NumpyOps()
        elif implementation == "c":
            try:
                self.ops = load_native()
            except OSError as exc:
                raise UserError(f"portable kernel: C build unavailable ({exc})") from None
        else:
            self.ops = ops()
        self.implementation = "numpy" if isinstance(self.ops, NumpyOps) else "c"
        self.threads = check_threads(threads)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 and self.implementation == "c" else None
        self._data = layout.parts[0].data  # offsets below are from its address (a split model: other maps too)
        self._base = self._data.ctypes.data
        self._experts: dict[tuple[int, int], tuple] = {}
        self._check_types()

    def _check_types(self) -> None:
        for tensors in self.layout.expert_tensors.values():
            for kind, t in tensors.items():
                if kind.endswith("_bias"):
                    continue
                check_shape(int(t.ggml_type), int(t.shape[2]), t.name)
                if row_bytes(int(t.ggml_type), int(t.shape[2])) * int(t.shape[1]) != t.expert_nbytes:
                    raise ModelFormatError(f"{t.name}: {t.expert_nbytes} bytes per expert do not match "
                                           f"{t.ggml_type.name} {t.shape[1]}x{t.shape[2]}")

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self.layers and self.expert_begin <= expert < self.expert_end

    def _matrices(self, layer: int, expert: int):
        """((wtype, offset, rows, k) for gate, up, down), from the layout; no bytes touched."""
        got = self._experts.get((layer, expert))
        if got is not None:
            return got
        check_held(self, layer, expert)
        tensors = self.layout.expert_tensors[layer]
        local = expert - self.expert_begin

        def mat(kind: str, row0: int = 0, rows: int | None = None):
            t = tensors[kind]
            off, _ = t.slab(local)
            wtype, k = int(t.ggml_type), int(t.shape[2])
            rows = int(t.shape[1]) if rows is None else rows
            return wtype, self._offset(off + row0 * row_bytes(wtype, k), rows * row_bytes(wtype, k)), rows, k

        if "gate_up" in tensors:
            ff = tensors["gate_up"].shape[1] // 2
            got = (mat("gate_up", 0, ff), mat("gate_up", ff, ff), mat("down"))
        else:
            got = (mat("gate"), mat("up"), mat("down"))
        self._experts[(layer, expert)] = got
        return got

    def _offset(self, off: int, n: int) -> int:
        """The model's bytes at ``off`` as an offset from ``self._base``: the same number for one
        file; for a split model, the address in the part's map that holds them, less the base."""
        part, part_off = self.layout.locate(off, n)
        return part.data.ctypes.data + part_off - self._base

    def _bytes(self, off: int, n: int) -> np.ndarray:
        """``n`` bytes at ``_base + off`` (an offset :meth:`_offset` made), as a uint8 view."""
        if 0 <= off and off + n <= self._data.nbytes:
            return self._data[off: off + n]
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(self._base + off))  # another part's map

    def _act(self, wtype: int, x: np.ndarray):
        if wtype in (F32, F16):
            return x
        return self.ops.quantize(x, ACT_BLOCK[wtype])

    def _matmul(self, m, act, n: int) -> np.ndarray:
        wtype, off, rows, k = m
        if isinstance(self.ops, NumpyOps):
            w = self._bytes(off, rows * row_bytes(wtype, k))
            return self.ops.matmul(wtype, w, rows, k, act, n)
        out = np.empty((n, rows), np.float32)
        ptr = self._base + off
        if self._pool is None or rows < 2 * self.threads or n * rows * k < self.min_macs_parallel:
            self.ops.matmul(wtype, ptr, 0, rows, k, act, n, out)
        else:
            step = -(-rows // self.threads)
            futs = [self._pool.submit(self.ops.matmul, wtype, ptr, r, min(rows, r + step), k, act, n, out)
                    for r in range(0, rows, step)]
            for f in futs:
                f.result()
        return out

    def forward(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * (up x)) for rows (n, n_embd) float32 -> (n, n_embd) float32."""
        x = np.ascontiguousarray(rows, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.n_embd:
            raise UserError(f"rows have shape {x.shape}, expected (n, {self.n_embd})")
        gate, up, down = self._matrices(layer, expert)
        n = x.shape[0]
        if n == 0:
            return np.zeros((0, self.n_embd), np.float32)
        if isinstance(self.ops, NativeOps) and (self._pool is None or n * gate[2] * gate[3] < self.min_macs_parallel):
            return self.ops.expert(gate, up, down, self._base, x)  # one thread: one C call for all of it
        ag = self._act(gate[0], x)
        au = ag if up[0] == gate[0] else self._act(up[0], x)
        g = self._matmul(gate, ag, n)
        u = self._matmul(up, au, n)
        h = np.ascontiguousarray(self.ops.swiglu(g, u), dtype=np.float32)
        return self._matmul(down, self._act(down[0], h), n)

    def forward_groups(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """Every (expert, row indices) group of one layer: rows[idx] through that expert, in order."""
        rows = np.asarray(rows, dtype=np.float32)
        return [self.forward(layer, e, np.ascontiguousarray(rows[np.asarray(idx)])) for e, idx in groups]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._experts.clear()
