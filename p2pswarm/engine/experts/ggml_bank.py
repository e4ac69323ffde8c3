"""The ggml expert bank: a worker's (or the backbone's replica's) routed experts on the mapped bytes.

Split from :mod:`p2pswarm.engine.ggml.lib` (which loads libggml, runs graphs and maps weights;
see its docstring for the why of the whole kernel): this module is the MoE part, every group of a
layer through one ``ggml_mul_mat_id`` per projection, as llama.cpp builds a MoE layer.
"""
from __future__ import annotations

import ctypes
from typing import Any, cast

import numpy as np

from p2pswarm.engine.ggml.lib import GGML_TYPE_F32, GGML_TYPE_I32, WEIGHT_TYPES, GgmlLib, load_libggml
from p2pswarm.engine.ggml.runner import GgmlRunner, _data, _i32_view, f32_view
from p2pswarm.engine.experts import expert_fn
from p2pswarm.engine.experts.numpy_bank import check_held
from p2pswarm.engine.ggml.inputs import INPUT_FORMS, InputQuantiser, form_for
from p2pswarm.engine.ggml.mapped_parts import map_layout
from p2pswarm.errors import ModelFormatError, UserError


def _u8_view(lib: GgmlLib, tensor, shape: tuple[int, int]) -> np.ndarray:
    """A numpy view of a tensor's bytes as (rows, row bytes) (an input already in a quantised form)."""
    buf = (ctypes.c_char * (shape[0] * shape[1])).from_address(_data(lib, tensor))
    return np.frombuffer(cast(Any, buf), dtype=np.uint8).reshape(shape)  # (a ctypes array is a buffer)


class GgmlExpertBank:
    """Routed experts of some layers and an expert range, computed by ggml on the mapped bytes.

    Implements :class:`p2pswarm.contracts.ExpertBank` (``forward``, ``forward_groups``,
    ``holds``, ``kernel``), like the numpy and portable banks, so the worker, the dispatcher and the backbone's
    fallback replica use either without knowing which. ``cache`` is None: nothing is dequantised.
    """

    cache = None

    def __init__(self, layout, *, threads: int | None = None, lib: GgmlLib | None = None, graph_cache_bytes: int = 0,
                 scratch_keep_bytes: int | None = None):
        self.lib = lib or load_libggml()
        self.kernel = self.lib.kernel_id
        self.layout = layout
        self.layers = frozenset(layout.expert_layers)
        self.expert_begin = layout.expert_begin
        self.expert_end = layout.expert_end
        self.n_embd = int(layout.hparam("embedding_length", required=True))
        # graph_cache_bytes: kept graphs of recurring request shapes (a decode step of one sequence
        # sends the same number of rows every step): the backbone's replica keeps up to its
        # P2PSWARM_GRAPH_CACHE_MB, a worker a small P2PSWARM_WORKER_GRAPH_CACHE_MB (GgmlRunner.graph)
        # scratch_keep_bytes: the backbone's replica keeps a prefill's scratch (GgmlRunner), a worker 64 MB
        self.runner = GgmlRunner(self.lib, threads, graph_cache_bytes=graph_cache_bytes,
                                 keep_bytes=scratch_keep_bytes)
        self.threads = self.runner.threads
        self._mapped = map_layout(self.lib, layout)
        self._experts: dict[tuple[int, int], tuple] = {}
        self._layers: dict[int, tuple] = {}
        self._check_types()
        # gpt-oss: biases added by expert id (ggml_add_id) and ggml's swiglu_oai, as llama.cpp builds it
        self.oai = expert_fn.activation(layout) == expert_fn.SWIGLU_OAI
        if self.oai and (self.lib.add_id is None or self.lib.swiglu_oai is None):
            raise ModelFormatError(f"{layout.path}: this libggml has no ggml_swiglu_oai/ggml_add_id, which "
                                   f"{layout.arch} experts need (use a newer ggml or --kernel numpy)")
        #: per layer, the form ggml turns this layer's expert inputs into (p2pswarm.engine.ggml.inputs)
        self._forms = {layer: form_for(self.lib, [int(t[k].ggml_type) for k in (("gate_up",) if "gate_up" in t
                                                                               else ("gate", "up"))], self.n_embd)
                       for layer, t in layout.expert_tensors.items()}
        self._quantise = InputQuantiser(self.lib)

    def input_form(self, layer: int) -> str | None:
        """The form this layer's input rows may arrive in instead of float32 (None: float32 only)."""
        return self._forms.get(layer)

    def input_forms(self) -> list[str]:
        """Every form some layer held here takes (a worker's hello lists them)."""
        return sorted({f for f in self._forms.values() if f is not None})

    def quantise_input(self, layer: int, rows: np.ndarray) -> tuple[np.ndarray, str | None]:
        """``rows`` as ggml would turn them into for ``layer``'s experts: (bytes, form), or the
        float32 rows and None where the layer takes no other form."""
        form = self._forms.get(layer)
        return (rows, None) if form is None else (self._quantise(form, rows), form)

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
        check_held(self, layer, expert)
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

    def local_ids(self, experts: list[int], sizes: list[int]) -> np.ndarray:
        """Each (group, row) pair's local expert index, groups in order: ``mul_mat_id``'s ids."""
        return np.repeat(np.array([e - self.expert_begin for e in experts], np.int32), sizes)

    def layer_parts(self, layer: int) -> tuple:
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
        got = (gate, up, make("down"), ff, self._biases(layer) if self.oai else None)
        self._layers[layer] = got
        return got

    def _biases(self, layer: int) -> tuple:
        """(gate, up, down) bias rows of every expert of ``layer`` held here: 2-D F32 tensors over
        the mapped bytes (one row per local expert) that ``ggml_add_id`` picks from."""
        tensors = self.layout.expert_tensors[layer]
        out = []
        for kind in ("gate_bias", "up_bias", "down_bias"):
            t = tensors.get(kind)
            if t is None or int(t.ggml_type) != GGML_TYPE_F32:
                raise ModelFormatError(f"{self.layout.path}: layer {layer} needs an F32 "
                                       f"ffn_{kind[:-5]}_exps.bias for {self.layout.arch} experts")
            off, _ = t.slab(0)
            out.append(self._mapped.tensor(GGML_TYPE_F32, t.shape[1], t.n_expert, off,
                                           f"{t.name}[{self.expert_begin}:]"))
        return tuple(out)

    def forward_groups(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]],
                       form: str | None = None) -> list[np.ndarray]:
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

        ``form``: the rows are already in that input form (:meth:`quantise_input`), which must be
        this layer's; the outputs are the bits the float32 rows would give.
        """
        E = self.n_embd
        if form is None:
            rows = np.asarray(rows, dtype=np.float32)
            width = E
        else:
            if form != self._forms.get(layer):
                raise UserError(f"rows in form {form}: layer {layer} takes {self._forms.get(layer) or 'float32 only'}")
            width = E // INPUT_FORMS[form][1] * INPUT_FORMS[form][2]
        if rows.ndim != 2 or rows.shape[1] != width:
            raise UserError(f"rows have shape {rows.shape}, expected (n, {width})")
        if not groups:
            return []
        for e, _ in groups:
            check_held(self, layer, e)
        idxs = [np.asarray(idx, dtype=np.int64).reshape(-1) for _, idx in groups]
        every = np.concatenate(idxs)  # one bounds check for all groups (two reductions, not two per group)
        if len(every) and (every.min() < 0 or every.max() >= rows.shape[0]):
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
            for k, out in zip(ks, self._forward_once(layer, rows, [groups[k][0] for k in ks], [idxs[k] for k in ks],
                                                     form)):
                result[k] = out
        return cast(list[np.ndarray], result)  # every group's, filled by its round

    def _forward_once(self, layer: int, rows: np.ndarray, experts: list[int], idxs: list[np.ndarray],
                      form: str | None = None) -> list[np.ndarray]:
        """One graph: every (expert, rows) pair through its expert, each expert at most once."""
        E = self.n_embd
        sizes = [len(i) for i in idxs]
        P = sum(sizes)
        if P == 0:
            return [np.zeros((0, E), np.float32) for _ in experts]
        lib = self.lib
        r = self.runner
        local = self.local_ids(experts, sizes)
        with r.lock:
            gate, up, down, ff, biases = self.layer_parts(layer)

            def build(g):
                ctx = g.ctx
                x = lib.new_tensor_3d(ctx, GGML_TYPE_F32 if form is None else INPUT_FORMS[form][0], E, 1, P)
                ids = lib.new_tensor_2d(ctx, GGML_TYPE_I32, 1, P)
                out = expert_nodes(lib, ctx, (gate, up, down, ff, biases), x, ids)  # (E, 1, P)
                lib.build_forward_expand(g.graph, out)
                x_view = f32_view(lib, x, (P, E)) if form is None else _u8_view(lib, x, (P, rows.shape[1]))
                return x_view, _i32_view(lib, ids, P), f32_view(lib, out, (P, E))

            # kept by (layer, P, form) where the runner keeps graphs: ids and rows are input data
            g = r.graph(("experts", layer, P, form), expert_bytes(P, E, ff, biases is not None) + 8 * 64, 14, build)
            try:
                x_in, ids_in, flat = g.t
                np.take(rows, np.concatenate(idxs), axis=0, out=x_in)
                ids_in[...] = local
                r.compute(g.graph, P * 3 * ff * E)
                result, at = [], 0
                for n in sizes:
                    result.append(flat[at:at + n].copy())
                    at += n
            finally:
                r.release(g)
        return result

    def close(self) -> None:
        self.runner.close()
        self._experts.clear()
        self._layers.clear()
        self._mapped.close()


def expert_nodes(lib: GgmlLib, ctx, parts: tuple, x, ids):
    """The routed experts' nodes of one call: ``x`` (E, 1, P) rows, ``ids`` (1, P) each pair's
    local expert, ``parts`` a layer's :meth:`GgmlExpertBank.layer_parts`; returns the (E, 1, P)
    output. One ``ggml_mul_mat_id`` per projection (llama.cpp's ``build_moe_ffn``; gpt-oss: bias by
    ``ggml_add_id``, ``swiglu_oai``). Shared by the bank's own graph and a layer graph that computes
    the previous layer's experts in front of its attention (the same ops on the same shapes: the
    same bits, see :meth:`GgmlExpertBank.forward_groups`)."""
    gate, up, down, _, biases = parts
    if isinstance(gate, tuple):  # fused gate_up: two strided views of one tensor
        g_w, u_w = (lib.view_3d(ctx, *view) for view in (gate, up))
    else:
        g_w, u_w = gate, up
    g_out, u_out = lib.mul_mat_id(ctx, g_w, x, ids), lib.mul_mat_id(ctx, u_w, x, ids)
    if biases is None:
        return lib.mul_mat_id(ctx, down, lib.swiglu_split(ctx, g_out, u_out), ids)
    # gpt-oss: llama.cpp's build_moe_ffn order (bias, swiglu_oai, down, bias)
    assert lib.add_id is not None and lib.swiglu_oai is not None  # the bank refuses gpt-oss without them
    g_out, u_out = lib.add_id(ctx, g_out, biases[0], ids), lib.add_id(ctx, u_out, biases[1], ids)
    h = lib.swiglu_oai(ctx, g_out, u_out, expert_fn.SWIGLU_OAI_ALPHA, expert_fn.SWIGLU_OAI_LIMIT)
    return lib.add_id(ctx, lib.mul_mat_id(ctx, down, h, ids), biases[2], ids)


def expert_bytes(P: int, E: int, ff: int, biased: bool) -> int:
    """Room (bytes) :func:`expert_nodes` of ``P`` pairs take in a graph, its input rows included."""
    return 4 * P * (2 * E + 3 * ff + 1) + (4 * P * (2 * ff + E) if biased else 0)


class ExpertsInFront:
    """A layer's routed experts on this bank, their combine and the residual add, as the first
    nodes of the NEXT layer's graph (the local path, every expert here): one graph where a decode
    layer boundary ran two (the bank's and the layer's) with numpy between them.

    The same bits as the bank's call followed by :func:`~p2pswarm.backbone.serving.combine.combine_outputs`
    and the layer's ``layer_out`` (``h + moe``, or ``h + (moe + shared)`` with ``shared``, a shared
    expert's output the layer's graph computed): the experts are :func:`expert_nodes` on the same
    (E, 1, P) rows in the same group order (each expert once: the kernel of an expert depends on
    its own rows only); the combine picks each (slot, row)'s output (``ggml_get_rows``: a copy),
    multiplies it by its weight and sums the slots in top-k order, ``((y0 + y1) + y2) + ...``, as
    numpy does, element by element in float32. :meth:`of` returns None where that cannot hold (an
    expert in two groups, a row that did not choose its group's expert once, an extra the layer's
    output would need that is not a shared expert)."""

    def __init__(self, bank: GgmlExpertBank, layer: int, h: np.ndarray, cur: np.ndarray, shared: np.ndarray | None,
                 rows: np.ndarray, local: np.ndarray, sel: np.ndarray, weights: np.ndarray, k: int):
        self.bank, self.layer, self.h, self.cur, self.shared = bank, layer, h, cur, shared
        self.rows, self.local, self.sel, self.weights, self.k = rows, local, sel, weights, k
        self.P = len(rows)
        self.key = ("experts-in-front", id(bank), layer, self.P, k, shared is not None)

    @classmethod
    def of(cls, bank: GgmlExpertBank, layer: int, h: np.ndarray, cur: np.ndarray, ids: np.ndarray,
           weights: np.ndarray, groups: list[tuple[int, np.ndarray]], extras: dict) -> "ExpertsInFront | None":
        if set(extras) - {"shared"}:
            return None
        got = slot_pairs(bank, layer, ids, weights, groups)
        if got is None:
            return None
        rows, local, sel, w = got
        return cls(bank, layer, h, cur, extras.get("shared"), rows, local, sel, w, ids.shape[1])

    def cost(self) -> tuple[int, int, int]:
        """(bytes, tensors, multiply-adds) the nodes add to a graph of these rows."""
        T, E = self.h.shape
        _, _, _, ff, biases = self.bank.layer_parts(self.layer)
        nbytes = expert_bytes(self.P, E, ff, biases is not None) + 4 * (3 * self.k * T * E + 4 * T * E + 2 * self.k * T)
        return nbytes, 24 + self.k, self.P * 3 * ff * E

    def nodes(self, lib: GgmlLib, ctx):
        """``h + combine(experts(cur))`` (``+ shared`` inside) as nodes: ``(that node, its inputs to fill)``."""
        T, E = self.h.shape
        P, k = self.P, self.k
        h_in = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
        x = lib.new_tensor_3d(ctx, GGML_TYPE_F32, E, 1, P)
        ids = lib.new_tensor_2d(ctx, GGML_TYPE_I32, 1, P)
        sel = lib.new_tensor_1d(ctx, GGML_TYPE_I32, k * T)
        w = lib.new_tensor_2d(ctx, GGML_TYPE_F32, 1, k * T)
        views = [f32_view(lib, h_in, (T, E)), f32_view(lib, x, (P, E)), _i32_view(lib, ids, P),
                 _i32_view(lib, sel, k * T), f32_view(lib, w, (1, k * T))]
        shared = None
        if self.shared is not None:
            shared = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
            views.append(f32_view(lib, shared, (T, E)))
        return combine_nodes(lib, ctx, self.bank.layer_parts(self.layer), h_in, x, ids, sel, w, E, T, k, P,
                             shared), views

    def fill(self, views) -> None:
        h_in, x, ids, sel, w = views[:5]
        h_in[...] = self.h
        np.take(self.cur, self.rows, axis=0, out=x)
        ids[...] = self.local
        sel[...] = self.sel
        w[...] = self.weights
        if self.shared is not None:
            views[5][...] = self.shared


def slot_pairs(bank: GgmlExpertBank, layer: int, ids: np.ndarray, weights: np.ndarray,
               groups: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """What :class:`ExpertsInFront`'s nodes take from a layer's routing: ``(rows, local, sel,
    weights)``, the row of each of the P (group, row) pairs in group order, each pair's local
    expert id, each (slot, row)'s position among the pairs (slot-major) and the weights as one
    (1, k * T) row in that order; None where the nodes would not give :meth:`GgmlExpertBank.forward_groups`'
    bits (an expert in two groups, one not held here, a row that did not choose its group's expert once)."""
    T, k = ids.shape
    experts = [e for e, _ in groups]
    if not groups or len(set(experts)) != len(experts) or not all(bank.holds(layer, e) for e in experts):
        return None
    if T == 1 and all(len(r) == 1 for _, r in groups):  # a one-sequence decode step: one pair per group
        row = ids[0].tolist()
        # every slot's expert has its group and chose it once (what the loop below checks for any T)
        if len(set(row)) != k or set(row) != set(experts):
            return None
        group_of = {e: j for j, e in enumerate(experts)}
        return (np.zeros(k, np.int64), bank.local_ids(experts, [1] * k),
                np.array([group_of[e] for e in row], np.int32),
                np.ascontiguousarray(weights, dtype=np.float32).reshape(1, -1))
    idxs = [np.asarray(r, dtype=np.int64).reshape(-1) for _, r in groups]
    pair = np.full((k, T), -1, np.int64)  # (slot, row) -> its position among the P pairs
    at = 0
    for e, r in zip(experts, idxs):
        match = ids[r] == e
        if not (match.sum(axis=1) == 1).all():
            return None
        pair[match.argmax(axis=1), r] = np.arange(at, at + len(r))
        at += len(r)
    if (pair < 0).any():  # a (row, slot) no group computes
        return None
    return (np.concatenate(idxs), bank.local_ids(experts, [len(r) for r in idxs]),
            pair.reshape(-1).astype(np.int32), np.ascontiguousarray(weights.T, dtype=np.float32).reshape(1, -1))


def combine_nodes(lib: GgmlLib, ctx, parts: tuple, h, x, ids, sel, w, E: int, T: int, k: int, P: int, shared=None):
    """``h + combine(experts(x))`` as nodes (``+ shared`` inside the sum): :func:`expert_nodes` on
    ``x`` (E, 1, P) with ``ids`` (1, P), each (slot, row)'s output picked by ``sel`` (k * T,
    slot-major; ``ggml_get_rows``: a copy), times its weight ``w`` (1, k * T), the slots summed in
    top-k order ``((y0 + y1) + y2) + ...`` as numpy's combine sums them, element by element in float32.
    Where the inputs come from is the caller's: filled by :class:`ExpertsInFront`, or computed in
    the same graph (a decode step as one graph, the router's choice by a Python node)."""
    assert lib.mul and lib.add and lib.view_2d and lib.reshape_2d  # in every libggml we build
    out = expert_nodes(lib, ctx, parts, x, ids)  # (E, 1, P)
    y = lib.mul(ctx, lib.get_rows(ctx, lib.reshape_2d(ctx, out, E, P), sel), w)  # (E, k*T): slot-major
    acc = lib.view_2d(ctx, y, E, T, 4 * E, 0)
    for j in range(1, k):
        acc = lib.add(ctx, acc, lib.view_2d(ctx, y, E, T, 4 * E, 4 * E * T * j))
    if shared is not None:
        acc = lib.add(ctx, acc, shared)
    return lib.add(ctx, h, acc)


def rows_node(lib: GgmlLib, ctx, T: int, E: int, front: ExpertsInFront | None):
    """A layer graph's input rows (E, T): an input tensor, or with ``front`` the previous layer's
    experts and residual computed in front. ``(node, numpy view of the rows to fill or None, the
    front's inputs or None)``."""
    if front is None:
        ht = lib.new_tensor_2d(ctx, GGML_TYPE_F32, E, T)
        return ht, f32_view(lib, ht, (T, E)), None
    ht, fills = front.nodes(lib, ctx)
    return ht, None, fills
