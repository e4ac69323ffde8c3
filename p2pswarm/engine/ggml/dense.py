"""The backbone's dense path on quantised weights: ``x @ W.T`` and ``W[ids]`` by libggml.

Split from :mod:`p2pswarm.engine.ggml.lib` (library loading, the graph runner, mapped weights):
the dense tensors of a model (attention, DeltaNet projections, shared expert, embedding, lm head)
stay in the memory map as :class:`QuantisedMatrix` objects that numpy code multiplies as if they
were arrays (:meth:`p2pswarm.engine.backend.DenseBackend.take` installs them at load).
"""
from __future__ import annotations

import ctypes

import numpy as np

from p2pswarm import settings
from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GGML_TYPE_I32, QUANTISED_TYPES, WEIGHT_TYPES, GgmlLib, load_libggml
from p2pswarm.engine.ggml.runner import GgmlRunner, _i32_view, f32_view
from p2pswarm.engine.ggml.mapped_parts import map_layout


#: libggml's type id of Q8_0 (``enum ggml_type``)
GGML_TYPE_Q8_0 = 8
#: split a Q8_0 mat-mul of ``n >= 5`` rows with ``n % 4 == 1`` into ``n - 1`` rows and one row
#: (:func:`mul_mat_rows`); False: one ``mul_mat`` whatever ``n`` (the old graphs, for A/B and tests)
SPLIT_LONE_TAIL = True
#: what one split adds to a graph: tensors (two row views, two mul_mats, the concat) ...
SPLIT_TENSORS = 5


def split_rows(w, n: int) -> int:
    """Rows of the first part where :func:`mul_mat_rows` splits ``x @ W.T`` of ``n`` rows, else 0.

    Why: llamafile's Q8_0 kernel (``tinyBLAS_Q0_AVX``, what libggml runs for 2+ rows) tiles the
    rows by 4 and computes a remainder of ONE row with a 4x1 tile, a second pass over the whole
    weight that costs more than libggml's one-row ``vec_dot`` (a 5-row verification chunk of K=4
    drafts: 4x4 tiles + a 4x1 pass). So ``4q + 1`` rows go as ``4q`` (tiles) + 1 (``vec_dot``,
    the kernel of a decode step). Measured on the 2-core AVX-512 VM, one thread, 5 rows
    (``bench/verify_stages.py --ab-split`` for whole layers): the 122B's DeltaNet ``attn_qkv``
    (12288 x 3072) 9.2 -> 7.8 ms, ``attn_gate`` 5.5 -> 4.6 ms; ``ssm_out`` (3072 x 8192) and the
    shared expert unchanged; a 151,936-row head 123 -> 116 ms (9 rows 174 -> 156).
    Bits: each row's value is the same either way, because libggml's Q8_0
    mat-mul is row-invariant (the same per-row sums in the same order at any row count; measured
    per layer at start by :func:`p2pswarm.backbone.serving.runner.probe_dense_invariance`, and
    pinned by ``tests/test_tile_split.py``). ``w``: a ggml tensor (its ``type`` is the struct's first
    field); only Q8_0 is split: other types take other kernels whose row counts may change bits."""
    if not SPLIT_LONE_TAIL or n < 5 or n % 4 != 1:
        return 0
    return n - 1 if ctypes.c_int32.from_address(w).value == GGML_TYPE_Q8_0 else 0


def mul_mat_rows(lib, ctx, w, x, in_n: int, n: int):
    """``ggml_mul_mat(w, x)`` for a contiguous ``x`` of ``n`` rows of ``in_n`` floats, split as
    :func:`split_rows` says (two ``mul_mat`` on row views, joined by ``ggml_concat``: the result
    is the same contiguous [out, n] tensor). A graph that calls it budgets :func:`split_cost` more."""
    s = split_rows(w, n)
    if not s:
        return lib.mul_mat(ctx, w, x)
    head = lib.view_2d(ctx, x, in_n, s, 4 * in_n, 0)
    tail = lib.view_2d(ctx, x, in_n, n - s, 4 * in_n, 4 * in_n * s)
    return lib.concat(ctx, lib.mul_mat(ctx, w, head), lib.mul_mat(ctx, w, tail), 1)


def split_cost(out_n: int, n: int) -> tuple[int, int]:
    """(floats, tensors) one :func:`mul_mat_rows` of ``n`` rows into ``out_n`` may add to a graph:
    the two parts' results besides the joined one (a graph context that runs out aborts)."""
    return (out_n * n, SPLIT_TENSORS) if SPLIT_LONE_TAIL and n >= 5 and n % 4 == 1 else (0, 0)


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
        #: fewer rows than this are multiplied padded to this many (copies of the last row), and
        #: the extra rows dropped: ggml's F32 mat-mul of ONE row takes another kernel than of two
        #: or more (measured 1 ulp apart), so without the pad a sequence's router logits alone
        #: would differ from the same rows in a batch; with it every call takes one kernel.
        self.min_rows = 2 if ggml_type == GGML_TYPE_F32 else 1

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
    def rmatmul_t(self, x: np.ndarray, *, norm=None, eps: float = 0.0, front=None) -> np.ndarray:
        """x @ W.T for x (..., in) float32 -> (..., out) float32, by ggml_mul_mat(W, x); with ``norm``
        (an F32 ggml tensor of ``in`` values) ``rms_norm(x) * norm @ W.T`` in the same graph (the
        model's final norm and its lm head, as llama.cpp's graph ends). ``front`` (an
        :class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront` whose ``h`` is ``x``): the rows
        are the last layer's residual plus its experts, computed first in the same graph."""
        if front is not None:
            return self._after(front, norm, eps)
        x = np.asarray(x, dtype=np.float32)
        out_n, in_n = self.shape
        if x.shape[-1] != in_n:
            raise ValueError(f"matmul: {x.shape} @ {self.name}.T of shape ({in_n}, {out_n})")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_n)
        n = x2.shape[0]
        if n == 0:
            return np.zeros((*lead, out_n), np.float32)
        if n < self.min_rows:
            x2 = np.concatenate([x2, np.repeat(x2[-1:], self.min_rows - n, axis=0)])
        rows, n = n, x2.shape[0]
        lib, r = self.runner.lib, self.runner

        def build(g):
            xt = lib.new_tensor_2d(g.ctx, GGML_TYPE_F32, in_n, n)
            y = xt if norm is None else lib.mul(g.ctx, lib.rms_norm(g.ctx, xt, eps), norm)
            out = mul_mat_rows(lib, g.ctx, self.tensor, y, in_n, n)
            lib.build_forward_expand(g.graph, out)
            return f32_view(lib, xt, (n, in_n)), f32_view(lib, out, (n, out_n))

        more_floats, more_tensors = split_cost(out_n, n)
        # kept per row count (GgmlRunner.graph): a decode step multiplies the same n each step
        result = r.run_one(("matmul", self.tensor, norm, eps, n, more_tensors), 4 * n * (3 * in_n + out_n) + 4 * more_floats + 256,
                           5 + more_tensors, build, x2, n * in_n * out_n)
        return result[:rows].reshape(*lead, out_n)

    def _after(self, front, norm, eps: float) -> np.ndarray:
        """:meth:`rmatmul_t` of rows computed in front (2-D; a lone row padded with copies of
        itself to ``min_rows`` inside the graph, as the numpy pad copies it)."""
        out_n, in_n = self.shape
        rows = front.h.shape[0]
        n = max(rows, self.min_rows)
        lib, r = self.runner.lib, self.runner
        more_bytes, more_tensors, more_macs = front.cost()

        def build(g):
            ctx = g.ctx
            xt, fills = front.nodes(lib, ctx)
            last = lib.view_2d(ctx, xt, in_n, 1, 4 * in_n, 4 * in_n * (rows - 1))
            for _ in range(n - rows):
                xt = lib.concat(ctx, xt, last, 1)
            y = xt if norm is None else lib.mul(ctx, lib.rms_norm(ctx, xt, eps), norm)
            out = mul_mat_rows(lib, ctx, self.tensor, y, in_n, n)
            lib.build_forward_expand(g.graph, out)
            return fills, f32_view(lib, out, (n, out_n))

        split_floats, split_tensors = split_cost(out_n, n)
        with r.lock:
            g = r.graph(("matmul", self.tensor, norm, eps, n, front.key, split_tensors),
                        4 * n * (4 * in_n + out_n) + 4 * split_floats + more_bytes + 256,
                        8 + n + more_tensors + split_tensors, build, recurs=True)
            try:
                fills, y = g.t
                front.fill(fills)
                r.compute(g.graph, n * in_n * out_n + more_macs)
                return y[:rows].copy()
            finally:
                r.release(g)

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

        def build(g):
            it = lib.new_tensor_1d(g.ctx, GGML_TYPE_I32, n)
            out = lib.get_rows(g.ctx, self.tensor, it)
            lib.build_forward_expand(g.graph, out)
            return _i32_view(lib, it, n), f32_view(lib, out, (n, in_n))

        return r.run_one(("get_rows", self.tensor, n), 4 * n * (in_n + 1) + 256, 3, build, ids.reshape(-1), 0)


def _dense_graph(x: np.ndarray, mats: list[QuantisedMatrix], swiglu: bool, gate_inp=None) -> list[np.ndarray]:
    """One ggml graph on one input: ``x @ W.T`` for every W (``swiglu`` False), or the whole
    ``down(silu(gate x) * (up x))`` of a dense FFN (``swiglu`` True, mats = gate, up, down), with
    ``gate_inp`` (an F32 ggml tensor of one row) scaled per row by ``sigmoid(gate_inp . x)``, as
    llama.cpp gates Qwen3.5's shared expert.

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

    def build(gr):
        ctx = gr.ctx
        xt = lib.new_tensor_2d(ctx, GGML_TYPE_F32, in_n, n)
        if swiglu:
            g, u, d = (m.tensor for m in mats)
            out = lib.mul_mat(ctx, d, lib.swiglu_split(ctx, lib.mul_mat(ctx, g, xt), lib.mul_mat(ctx, u, xt)))
            if gate_inp is not None:  # [E, T] * sigmoid([1, T]), broadcast over each row
                out = lib.mul(ctx, out, lib.sigmoid(ctx, lib.mul_mat(ctx, gate_inp, xt)))
            outs = [out]
        else:
            outs = [lib.mul_mat(ctx, m.tensor, xt) for m in mats]
        for o in outs:
            lib.build_forward_expand(gr.graph, o)
        return f32_view(lib, xt, (n, in_n)), [f32_view(lib, o, (n, on)) for o, on in zip(outs, out_ns)]

    with r.lock:  # kept per row count, as rmatmul_t's
        gr = r.graph(("dense", tuple(m.tensor for m in mats), swiglu, gate_inp, n),
                     4 * n * (in_n + inner + 2 * sum(out_ns) + 2) + 64 * (len(mats) + 8), len(mats) + 8, build)
        try:
            x_in, ys = gr.t
            x_in[...] = x2
            r.compute(gr.graph, macs)
            result = [y.reshape(*lead, on).copy() for y, on in zip(ys, out_ns)]
        finally:
            r.release(gr)
    return result


def fused_matmuls(x: np.ndarray, mats: list) -> list[np.ndarray] | None:
    """``[x @ W.T for W in mats]`` in one ggml graph when every W is a :class:`QuantisedMatrix` of
    one runner; None otherwise (the caller multiplies them one by one)."""
    if len(mats) < 2 or not all(isinstance(m, QuantisedMatrix) and m.runner is mats[0].runner for m in mats):
        return None
    return _dense_graph(x, list(mats), swiglu=False)


def fused_swiglu(x: np.ndarray, gate, up, down, gate_inp=None) -> np.ndarray | None:
    """A dense SwiGLU FFN (the shared expert) in one ggml graph, with ggml's SwiGLU as llama.cpp
    computes it, and with ``gate_inp`` its per-row sigmoid gate; None unless all three weights are
    :class:`QuantisedMatrix` of one runner."""
    mats = [gate, up, down]
    if not all(isinstance(m, QuantisedMatrix) and m.runner is gate.runner for m in mats):
        return None
    return _dense_graph(x, mats, swiglu=True, gate_inp=gate_inp)[0]


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
        from p2pswarm.engine.weights import to_float32  # engine-internal, avoids a cycle

        self.lib = lib or load_libggml()
        self.kernel = self.lib.kernel_id
        self.layout = layout
        # the dense path's graphs of a decode step are kept (GgmlRunner.graph); so are the backbone's
        # expert replica's (its own runner, session.open_backbone), a worker's never
        self.runner = GgmlRunner(self.lib, threads, graph_cache_bytes=settings.GRAPH_CACHE_MB.get() << 20,
                                 keep_bytes=settings.SCRATCH_MB.get() << 20)
        self._mapped = map_layout(self.lib, layout)
        self._to_float32 = to_float32
        self._by_name: dict | None = None
        self._vectors: dict[str, object] = {}  # f32_vector's, by name
        #: the one-graph DeltaNet layers' ggml tensors by layer, None where one cannot run
        #: (p2pswarm.engine.arch.qwen35moe.deltanet_graph.deltanet_layer_weights)
        self.deltanet_layers: dict[int, object] = {}
        #: the one-graph attention layers' ggml tensors by layer (p2pswarm.engine.ggml.attention.layer_tensors)
        self.attention_layers: dict[int, object] = {}
        #: a decode step as one graph: with which expert bank it runs, and its sizes (gptoss.graph.decode_step)
        self.decode_steps: dict = {}

    def eligible(self, t) -> bool:
        """Quantised 2-D tensors that are not routed experts (those are the expert bank's)."""
        return (int(t.tensor_type) in QUANTISED_TYPES and len(t.shape) == 2
                and "_exps." not in t.name)

    @staticmethod
    def router(t) -> bool:
        """The float32 router (``ffn_gate_inp``) of a layer: ggml's F32 mat-mul is llama.cpp's
        router, and, a lone row padded to two (:attr:`QuantisedMatrix.min_rows`), row-invariant,
        so the batch-invariant mode routes all sequences' rows in one call instead of one small
        numpy product per sequence."""
        return int(t.tensor_type) == GGML_TYPE_F32 and len(t.shape) == 2 and t.name.endswith(".ffn_gate_inp.weight")

    def matrix(self, t) -> QuantisedMatrix:
        ne0, ne1 = int(t.shape[0]), int(t.shape[1])
        gtype = int(t.tensor_type)
        tensor = self._mapped.tensor(gtype, ne0, ne1, int(t.data_offset), t.name)
        raw = t.data

        def dequantise():
            return self._to_float32(raw.reshape(-1) if raw.ndim else raw, t.tensor_type, (ne1, ne0), t.name)

        return QuantisedMatrix(self.runner, tensor, gtype, (ne1, ne0), t.name, dequantise)

    def mapped(self, name: str, types=WEIGHT_TYPES):
        """Tensor ``name`` of the file as a ggml tensor on the memory map (no copy), any weight type
        ggml multiplies (float ones included), a 1-D tensor as one row; None if its type is not in
        ``types``. What a whole-layer graph takes its float32 weights and norms from, where the
        dense path's numpy code would hold a dequantised copy."""
        t = self._tensors_by_name().get(name)
        if t is None or int(t.tensor_type) not in types:
            return None
        ne0 = int(t.shape[0])
        ne1 = int(np.prod([int(d) for d in t.shape[1:]])) if len(t.shape) > 1 else 1
        return self._mapped.tensor(int(t.tensor_type), ne0, ne1, int(t.data_offset), t.name)

    def f32_vector(self, name: str):
        """The file's F32 tensor ``name`` (a norm's weight) as a ggml tensor on the memory map, made
        once and kept; None if it is not F32."""
        if name not in self._vectors:
            self._vectors[name] = self.mapped(name, types=(GGML_TYPE_F32,))
        return self._vectors[name]

    def _tensors_by_name(self) -> dict:
        if self._by_name is None:
            self._by_name = {t.name: t for t in self.layout.reader.tensors}
        return self._by_name

    def leading_rows(self, name: str, rows: int) -> QuantisedMatrix:
        """The first ``rows`` rows of quantised tensor ``name`` as their own matrix (same bytes, same
        type, same kernels): what a probe of the lm head's row-invariance multiplies, since the
        whole 151,936-row head would cost seconds per probe call."""
        t = next(t for t in self.layout.reader.tensors if t.name == name)
        ne0, ne1 = int(t.shape[0]), int(t.shape[1])
        rows = max(1, min(rows, ne1))
        gtype = int(t.tensor_type)
        tensor = self._mapped.tensor(gtype, ne0, rows, int(t.data_offset), f"{name}[:{rows}]")
        raw = t.data

        def dequantise():
            return self._to_float32(raw[:rows].reshape(-1), t.tensor_type, (rows, ne0), t.name)

        return QuantisedMatrix(self.runner, tensor, gtype, (rows, ne0), f"{name}[:{rows}]", dequantise)
