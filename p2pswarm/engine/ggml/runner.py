"""Running ggml graphs and mapping weights: the part of the ggml kernel every ggml module shares.

:class:`GgmlRunner` is the one place graphs are built, kept (the graphs of a decode step, run again
while their shapes repeat) and computed, under one lock; :class:`MappedWeights` makes ggml tensors
whose data are byte ranges of the memory-mapped GGUF (never a copy); :func:`populate` maps a file's
pages in at start-up. Loading the library itself (and what :class:`~p2pswarm.engine.ggml.lib.GgmlLib`
binds) is :mod:`p2pswarm.engine.ggml.lib`; docs/kernels.md has the design and the numbers.
"""
from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
import time

from typing import Any, cast

import numpy as np

from p2pswarm.engine.ggml.cpu_share import GRAPH_THREAD_CAP, free_cpus
from p2pswarm.engine.ggml.lib import (CUSTOM_OP, MIN_MACS_PER_THREAD, TENSOR_ALIGNMENT, WEIGHT_TYPES, GgmlLib,
                                         GgmlUnavailable, _InitParams, check_threads)
from p2pswarm.errors import ModelFormatError

class GgmlRunner:
    """A CPU backend, a reusable compute context and a lock: build a graph, run it, read it back.

    Weights live elsewhere (in the memory map); this context only holds the activations of one
    call. It is reset, not freed, between calls, and regrown when a call needs more. A context
    grown past ``keep_bytes`` is released after the call, so one long prefill does not pin its
    scratch memory; one past ``KEEP_BYTES`` but within ``keep_bytes`` is kept while calls keep
    needing it and released after ``IDLE_RELEASE_S`` without one. Why keep it: a ggml context
    gives every node of a graph its own memory, so a 128-token prefill of DeepSeek-V3's layer needs
    ~320 MB of scratch per graph call, and memory freed and allocated again arrives as fresh pages:
    ~180,000 page faults and 0.3-0.5 CPU s of a 2.9 CPU s prefill when it was freed after every
    call (docs/benchmarks.md). Kept, the peak is the same (the call needs it either way); only the
    time it stays mapped grows. The backbone's runners keep up to ``P2PSWARM_SCRATCH_MB``; a
    worker's keep ``KEEP_BYTES`` (its memory is a phone's).

    With ``graph_cache_bytes``, :meth:`graph` also keeps built graphs, each in a context of its
    own, for the steps that repeat their shapes (the backbone's dense path and its expert replica;
    a worker's runner a few MiB of them, its memory is a phone's).
    """

    #: scratch always kept between calls (a worker's whole allowance)
    KEEP_BYTES = 64 << 20
    #: scratch above KEEP_BYTES (up to keep_bytes) is released after this many seconds unused
    IDLE_RELEASE_S = 10.0
    #: a kept graph larger than this is not kept (a long prefill's: its shape rarely recurs)
    GRAPH_ENTRY_BYTES = 32 << 20
    #: a kept graph not used in this many graph calls may be dropped to make room for a new one
    STALE_CALLS = 2048
    #: how many keys built once are remembered (a key is kept on its second build)
    SEEN_KEYS = 4096

    def __init__(self, lib: GgmlLib, threads: int | None = None, *, graph_cache_bytes: int = 0,
                 keep_bytes: int | None = None):
        self.lib = lib
        self.keep_bytes = max(self.KEEP_BYTES, keep_bytes or 0)
        self._used_at = 0.0  # monotonic time of the last call that needed the scratch kept above KEEP_BYTES
        self._idle_timer: threading.Timer | None = None
        self.threads = check_threads(threads)
        self._backend = lib.backend_cpu_init()
        if not self._backend:
            raise GgmlUnavailable("ggml_backend_cpu_init failed")
        self._ctx: int | None = None
        self._ctx_bytes = 0
        self.lock = threading.Lock()
        #: kept graphs (:meth:`graph`): key -> Graph, least recently used first
        self.graph_cache_bytes = graph_cache_bytes
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: collections.OrderedDict = collections.OrderedDict()  # keys built once, newest last
        self._graph_bytes = 0
        self._calls = 0
        self.graph_stats = {"reused": 0, "built": 0, "kept": 0, "dropped": 0}
        #: graphs computed (:meth:`compute` calls): what a decode step costs in graph starts
        self.computes = 0

    def context(self, nbytes: int, n_tensors: int):
        """A fresh (reset) compute context with room for ``nbytes`` of data in ``n_tensors``."""
        lib = self.lib
        need = self._context_bytes(nbytes, n_tensors)
        if self._ctx is not None and self._ctx_bytes >= need:
            lib.reset(self._ctx)
            return self._ctx
        self._free_ctx()
        # a quarter more than asked: the next call's rows may need a little more (a prefill's expert
        # groups vary with the routing), and a regrown context is all fresh pages; pages never
        # touched cost nothing
        size = max(need + need // 4, 1 << 20)
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

    def graph(self, key, nbytes: int, n_tensors: int, build, *, meta_tensors: int = 0,
              recurs: bool = False, entry_bytes: int | None = None) -> "Graph":
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
        the scratch context. ``recurs``: the caller knows the key recurs (a decode step's layer
        graph, keyed by live caches, runs again next step unless its sequences end), so it is kept
        on its first build; a new sequence then pays one build per layer, not two. ``entry_bytes``:
        the largest graph of this call kept (default ``GRAPH_ENTRY_BYTES``; a whole decode step's
        graph of a deep model is larger, and recurs every step). A kept graph
        computes the same bits as a fresh one: same ops, same
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
            if recurs or key in self._seen:  # its second build (or said to recur): the shape recurs
                cap = self.GRAPH_ENTRY_BYTES if entry_bytes is None else entry_bytes
                keep = need + meta_bytes <= cap and self._make_room(need + meta_bytes)
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
        cap = GRAPH_THREAD_CAP.get()  # (the verifier's spot checks: one thread, cpu_share.GRAPH_THREAD_CAP)
        if cap is not None:
            n = max(1, min(n, cap))
        if n > 1:  # no more threads than the CPUs other processes leave free (p2pswarm.engine.ggml.cpu_share)
            free = free_cpus()
            n = n if free is None else min(n, free)
        self.lib.backend_cpu_set_n_threads(self._backend, n)
        self.computes += 1
        status = self.lib.backend_graph_compute(self._backend, graph)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")

    def done(self) -> None:
        """After a call's outputs are read (hold ``self.lock``): scratch over ``keep_bytes`` is
        freed now, scratch over ``KEEP_BYTES`` after ``IDLE_RELEASE_S`` unused."""
        if self._ctx_bytes > self.keep_bytes:
            self._free_ctx()
        elif self._ctx_bytes > self.KEEP_BYTES:
            self._used_at = time.monotonic()
            if self._idle_timer is None:
                self._arm_idle_release(self.IDLE_RELEASE_S)

    def _arm_idle_release(self, after_s: float) -> None:
        timer = self._idle_timer = threading.Timer(after_s, self._idle_release)
        timer.daemon = True
        timer.start()

    def _idle_release(self) -> None:
        with self.lock:
            self._idle_timer = None
            if self._ctx_bytes <= self.KEEP_BYTES or self._backend is None:
                return
            left = self._used_at + self.IDLE_RELEASE_S - time.monotonic()
            if left > 0:  # used since the timer was armed
                self._arm_idle_release(left)
            else:
                self._free_ctx()

    def _free_ctx(self) -> None:
        if self._ctx is not None:
            self.lib.free(self._ctx)
            self._ctx, self._ctx_bytes = None, 0

    def close(self) -> None:
        with self.lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
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
        self.meta: int | None = None  # ggml_context* of tensors placed on outside memory
        self.graph: int | None = None  # ggml_cgraph*
        #: what the builder returned (the numpy views of its inputs and outputs), as it made them
        self.t: Any = None
        self.buffers: list = []
        self.keep: list = []
        self.kept = kept
        self.nbytes = nbytes
        self.used = 0

    def python_node(self, ggml_type: int, shape: tuple[int, ...], args: list, fn, errors: list):
        """A node of ``shape`` (ne0 first) whose value ``fn()`` writes (through numpy views made at
        build time) when the compute reaches it, after its ``args`` (nodes it reads or must follow):
        ``ggml_custom_4d``. Every thread of the compute calls a node's function (this ggml splits
        the work by ``ith`` inside each op; ``n_tasks`` only sizes the plan), so only ``ith`` 0, the
        thread that called compute (OpenMP's master, a Python thread that released the GIL in the
        ctypes call), runs ``fn``; the others go on to the node's barrier and wait there.
        Why: Python's own arithmetic (the router's top-k and softmax, numpy's bits) inside a graph,
        so a decode step is one graph, not one per layer with Python between them. An exception
        cannot cross ggml's C frames: it is appended to ``errors`` (the caller raises it after the
        compute) and ``fn``'s outputs must then hold values the later nodes can read safely. The
        callback is kept with the graph (freed, ggml would call freed code)."""
        lib = self.lib
        if lib.custom_4d is None:
            raise GgmlUnavailable("this libggml lacks ggml_custom_4d")

        def call(dst, ith, nth, userdata) -> None:
            if ith:
                return
            try:
                fn()
            except BaseException as exc:  # (KeyboardInterrupt too: nothing may unwind through C)
                errors.append(exc)

        cb = CUSTOM_OP(call)
        srcs = (ctypes.c_void_p * max(1, len(args)))(*args)
        self.keep.append(cb)
        ne = (tuple(shape) + (1, 1, 1, 1))[:4]
        node = lib.custom_4d(self.ctx, ggml_type, *ne, srcs, len(args), ctypes.cast(cb, ctypes.c_void_p), 1, None)
        if not node:
            raise MemoryError("ggml_custom_4d failed")
        return node

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
    buf = (ctypes.c_char * (4 * n)).from_address(_data(lib, tensor))
    return np.frombuffer(cast(Any, buf), dtype=np.float32).reshape(shape)  # (a ctypes array is a buffer)


def _i32_view(lib: GgmlLib, tensor, n: int) -> np.ndarray:
    """A numpy view of an I32 ggml tensor's n values."""
    return np.ctypeslib.as_array(ctypes.cast(_data(lib, tensor), ctypes.POINTER(ctypes.c_int32)), shape=(n,))


def _data(lib: GgmlLib, tensor) -> int:
    """The address of a tensor's data; a tensor with none (not yet allocated) is our bug."""
    addr = lib.get_data(tensor)
    if not addr:
        raise RuntimeError("a ggml tensor without data")
    return addr


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
