"""The dense path of ``qwen35moe`` (Qwen3.5 MoE): a hybrid of Gated DeltaNet and gated attention.

Same contract as :mod:`p2pswarm.engine.arch.qwen3moe` (the backbone's layer loop calls
``layer_in`` and ``layer_out``), so splitting the routed experts across workers works the
same way and stays bit-identical. What differs, layer by layer (see ../shared/QWEN35MOE-MATH.md
for the exact formulas as measured against llama.cpp):

* Most layers are *linear attention* (Gated DeltaNet, :mod:`p2pswarm.engine.arch.qwen35moe.deltanet`): a causal
  depthwise conv and a d x d state S per value head, carried between calls instead of a KV cache.
  Every ``full_attention_interval``-th layer (or as ``attention.recurrent_layers`` says) is *gated
  full attention*: q carries a per-head sigmoid gate, RoPE is IMROPE on a partial rotary slice.
* There is no ``ffn_norm``: the experts see ``post_attention_norm(h)``.
* A shared expert, scaled by a per-token sigmoid gate, is added to the routed experts' sum.
* The router normalises its top-k weights always (whatever ``expert_weights_norm`` says).

Per-sequence state: ``state.kv[il]`` (KV cache) for attention layers and ``state.extra[il]``
(:class:`~p2pswarm.engine.arch.qwen35moe.deltanet.DeltaNetState`: conv rows + S) for linear ones, one object per
sequence so a backbone can hold many.
"""
from __future__ import annotations

import numpy as np

from p2pswarm.engine.ggml import attention as ggml_attention, dense as ggml_dense
from p2pswarm.engine import ops
from p2pswarm.contracts import LayerIn, MtpEnds, Routed
from p2pswarm.engine.arch.common import DenseWeights, LayerByGraph, TokenEnds, nextn_head_norm
import p2pswarm.engine.arch.qwen35moe.deltanet as deltanet  # (not ``from``: the package imports this module)
import p2pswarm.engine.arch.qwen35moe.deltanet_graph as ggml_layers
import p2pswarm.engine.arch.qwen35moe.ggml_deltanet as ggml_deltanet
from p2pswarm.engine.arch.qwen35moe.graph import gated_attention
from p2pswarm.engine.backend import NUMPY, DenseBackend
from p2pswarm.engine.state import KVCache, SequenceState
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


class Qwen35MoE(TokenEnds, LayerByGraph):
    """qwen35moe: Gated DeltaNet + gated full attention, routed experts + a sigmoid-gated shared expert."""

    arch = "qwen35moe"

    #: "auto" (chunked for prefill, recurrent for one token), "chunked" or "recurrent"; tests and
    #: benchmarks pin one form, the math is the same.
    deltanet_mode = "auto"
    #: how many DeltaNet ``pre_moe_batch`` calls ran as one ggml graph (tests and profiles read it)
    layer_graph_calls = 0
    #: the previous layer's experts and layer_out may run in front of a layer's graph (layer_in_after)
    experts_in_front = True

    def __init__(self, layout: ModelLayout, backend: DenseBackend = NUMPY):
        self.backend = backend  # numpy's dense path, or ggml's graphs: chosen at load (engine.backend)
        self.layout = layout
        path = layout.path

        def hp(key, default=None):
            return layout.hparam(key, default, required=default is None)

        def as_int(key, default=None) -> int:
            v = hp(key, default)
            if isinstance(v, list):
                # per-layer arrays (some converters write head counts per layer, 0 on DeltaNet
                # layers): fine when every non-zero entry agrees
                distinct = {x for x in v if isinstance(x, int) and not isinstance(x, bool) and x != 0}
                if len(distinct) != 1 or any(not isinstance(x, int) or isinstance(x, bool) for x in v):
                    raise ModelFormatError(f"{path}: key {self.arch}.{key} must be an integer (or a per-layer "
                                           f"array with one non-zero value), got {v!r}")
                v = distinct.pop()
            if isinstance(v, bool):
                raise ModelFormatError(f"{path}: key {self.arch}.{key} must be an integer, got {v!r}")
            try:
                return int(v)
            except (TypeError, ValueError):
                raise ModelFormatError(f"{path}: key {self.arch}.{key} must be an integer, got {v!r}") from None

        def as_float(key, default=None) -> float:
            v = hp(key, default)
            if isinstance(v, (bool, list, str)):
                raise ModelFormatError(f"{path}: key {self.arch}.{key} must be a number, got {v!r}")
            return float(v)

        self.n_ctx_train = as_int("context_length")
        self.n_block = as_int("block_count")
        # Qwen3.5 GGUFs may append multi-token-prediction blocks (``nextn_predict_layers``; by its
        # config the 122B has 48 layers + 1 MTP block, the brief's 49). They serve speculative
        # drafting, not the forward pass, which runs the first block_count - nextn_predict_layers
        # blocks; their experts still sit in the file and in shards, never requested.
        self.n_layer_nextn = as_int("nextn_predict_layers", 0)
        self.n_layer = self.n_block - self.n_layer_nextn
        self.n_embd = as_int("embedding_length")
        self.eps = as_float("attention.layer_norm_rms_epsilon")
        self.n_head = as_int("attention.head_count")
        self.n_head_kv = as_int("attention.head_count_kv", self.n_head)
        self.head_dim = as_int("attention.key_length", self.n_embd // max(self.n_head, 1))
        v_len = as_int("attention.value_length", self.head_dim)
        self.n_rot = as_int("rope.dimension_count", self.head_dim)
        self.rope_base = as_float("rope.freq_base", 10000.0)
        sections = hp("rope.dimension_sections")
        self.n_expert = as_int("expert_count")
        self.n_expert_used = as_int("expert_used_count")
        self.ssm_kernel = as_int("ssm.conv_kernel")
        self.ssm_inner = as_int("ssm.inner_size")
        self.ssm_d = as_int("ssm.state_size")
        self.ssm_hv = as_int("ssm.time_step_rank")
        self.ssm_hk = as_int("ssm.group_count")

        def bad(msg: str) -> ModelFormatError:
            return ModelFormatError(f"{path}: {msg}")

        if not isinstance(sections, list) or len(sections) < 4 or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sections[:4]):
            raise bad(f"key {self.arch}.rope.dimension_sections must be 4 non-negative integers, got {sections!r}")
        self.rope_sections = tuple(int(s) for s in sections[:4])
        if sum(self.rope_sections) <= 0:
            raise bad(f"key {self.arch}.rope.dimension_sections sums to 0")
        if not 0 <= self.n_layer_nextn < self.n_block:
            raise bad(f"key {self.arch}.nextn_predict_layers {self.n_layer_nextn} must be below block_count "
                      f"{self.n_block}")
        for name, v in (("block_count", self.n_layer), ("embedding_length", self.n_embd),
                        ("attention.head_count", self.n_head), ("attention.head_count_kv", self.n_head_kv),
                        ("attention.key_length", self.head_dim), ("expert_count", self.n_expert),
                        ("expert_used_count", self.n_expert_used), ("ssm.conv_kernel", self.ssm_kernel),
                        ("ssm.inner_size", self.ssm_inner), ("ssm.state_size", self.ssm_d),
                        ("ssm.time_step_rank", self.ssm_hv), ("ssm.group_count", self.ssm_hk)):
            if v <= 0:
                raise bad(f"key {self.arch}.{name} must be positive, got {v}")
        if v_len != self.head_dim:
            raise bad(f"attention.value_length {v_len} != attention.key_length {self.head_dim} (unsupported)")
        if self.n_head % self.n_head_kv:
            raise bad(f"attention.head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            raise bad(f"rope.dimension_count {self.n_rot} must be even and at most the head size {self.head_dim}")
        if self.ssm_inner % self.ssm_hv:
            raise bad(f"ssm.inner_size {self.ssm_inner} is not a multiple of ssm.time_step_rank {self.ssm_hv}")
        if self.ssm_hv % self.ssm_hk:
            raise bad(f"ssm.time_step_rank {self.ssm_hv} is not a multiple of ssm.group_count {self.ssm_hk}")
        if self.n_expert_used > self.n_expert:
            raise bad(f"expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}")
        self.ssm_dv = self.ssm_inner // self.ssm_hv
        self.conv_channels = 2 * self.ssm_hk * self.ssm_d + self.ssm_inner

        self.recurrent = self._layer_kinds(hp)
        self.w = DenseWeights(layout)
        tied = not self.w.has("output.weight")
        self.output_name = "token_embd.weight" if tied else "output.weight"
        self.n_vocab = int(layout.tensor("token_embd.weight").shape[1])
        self.shared_expert = [False] * self.n_layer
        self._check_tensors()

    # ---- model description ------------------------------------------------------------------
    def _layer_kinds(self, hp) -> list[bool]:
        """True for a linear-attention layer: ``attention.recurrent_layers`` if present, else every
        layer except each ``full_attention_interval``-th (default 4: layers 3, 7, ... are full)."""
        rec = self.layout.hparam("attention.recurrent_layers")
        if rec is not None:
            if not isinstance(rec, list) or len(rec) not in (self.n_layer, self.n_block) or not all(
                    isinstance(r, (bool, int)) for r in rec):
                raise ModelFormatError(
                    f"{self.layout.path}: key {self.arch}.attention.recurrent_layers must list {self.n_block} "
                    f"booleans, got {rec!r}")
            return [bool(r) for r in rec[: self.n_layer]]
        interval = hp("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ModelFormatError(
                f"{self.layout.path}: key {self.arch}.full_attention_interval must be a positive integer, got {interval!r}")
        return [(il + 1) % interval != 0 for il in range(self.n_layer)]

    def _check_tensors(self) -> None:
        """Every tensor the forward pass reads, present and of the right shape: one line naming the first
        that is not, rather than a numpy error halfway through a forward pass."""
        E, V = self.n_embd, self.n_vocab
        H, Hkv, hd = self.n_head, self.n_head_kv, self.head_dim
        Hv, dv, K, C = self.ssm_hv, self.ssm_dv, self.ssm_kernel, self.conv_channels
        need: list[tuple[str, tuple[int, ...] | None]] = [
            ("token_embd.weight", (V, E)), ("output_norm.weight", (E,)),
        ]
        if self.output_name == "output.weight":
            need.append(("output.weight", (V, E)))
        shexp = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
        for il in range(self.n_layer):
            p = f"blk.{il}."
            need += [(p + "attn_norm.weight", (E,)), (p + "post_attention_norm.weight", (E,)),
                     (p + "ffn_gate_inp.weight", (self.n_expert, E))]
            if self.recurrent[il]:
                need += [(p + "attn_qkv.weight", (C, E)), (p + "attn_gate.weight", (Hv * dv, E)),
                         (p + "ssm_conv1d.weight", (C, K)), (p + "ssm_dt.bias", (Hv,)), (p + "ssm_a", (Hv,)),
                         (p + "ssm_beta.weight", (Hv, E)), (p + "ssm_alpha.weight", (Hv, E)),
                         (p + "ssm_norm.weight", (dv,)), (p + "ssm_out.weight", (E, Hv * dv))]
            else:
                need += [(p + "attn_q.weight", (2 * H * hd, E)), (p + "attn_k.weight", (Hkv * hd, E)),
                         (p + "attn_v.weight", (Hkv * hd, E)), (p + "attn_output.weight", (E, H * hd)),
                         (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
            present = [self.w.has(p + n) for n in shexp]
            if any(present):
                missing = [p + n for n, ok in zip(shexp, present) if not ok]
                if missing:
                    raise ModelFormatError(f"{self.layout.path}: required tensor {missing[0]!r} is missing "
                                           "(the layer has part of a shared expert)")
                self.shared_expert[il] = True
                ffs = int(self.w.shape(p + "ffn_gate_shexp.weight")[0])
                need += [(p + "ffn_gate_inp_shexp.weight", (E,)), (p + "ffn_gate_shexp.weight", (ffs, E)),
                         (p + "ffn_up_shexp.weight", (ffs, E)), (p + "ffn_down_shexp.weight", (E, ffs))]
            if il not in self.layout.expert_tensors:
                raise ModelFormatError(f"{self.layout.path}: layer {il} has no routed-expert tensors "
                                       f"(blk.{il}.ffn_*_exps.weight)")
        for name, shape in need:
            if not self.w.has(name):
                raise ModelFormatError(f"{self.layout.path}: required tensor {name!r} is missing")
            got = self.w.shape(name)
            if shape is not None and tuple(got) != shape:
                # a 1-D tensor may be stored with trailing unit dims ((n, 1) in numpy order is (1, n))
                if int(np.prod(got)) == int(np.prod(shape)) and len(shape) == 1:
                    continue
                raise ModelFormatError(f"{self.layout.path}: tensor {name!r} has shape {tuple(got)}, expected {shape}")

    # ---- per sequence -----------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        st = SequenceState()
        for il in range(self.n_layer):
            if self.recurrent[il]:
                st.extra[il] = deltanet.DeltaNetState(self.conv_channels, self.ssm_kernel, self.ssm_hv,
                                                      self.ssm_d, self.ssm_dv)
            else:
                st.kv[il] = KVCache(self.n_head_kv, self.head_dim)
        return st

    # ---- the layer pieces (embed, output: common.TokenEnds) ---------------------------------
    def layer_out(self, il: int, lin: LayerIn, moe: np.ndarray) -> np.ndarray:
        """h + (routed + shared), added in llama.cpp's order; the shared expert from the layer's
        graph where that computed it."""
        shared = lin.extras.get("shared")
        return lin.h + (moe + (shared if shared is not None else self.shared(il, lin.cur)))

    def graph_layer(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]], front=None):
        """``(h, post_attention_norm(h), {"logits", "shared"} where it computed them)`` of the layer
        for the rows of several sequences (``h`` holds, in order, the ``n`` rows of each ``(state,
        pos0, n)`` segment) as one ggml graph; None where it does not run (then the pieces).

        Why batched: everything but the recurrence and the attention itself is row-wise (norms,
        projections, gates, output projection), so it runs once over all rows: a decode step of 16
        sequences streams each dense weight once instead of 16 times. Only the conv + delta rule
        (DeltaNet) or RoPE'd KV + attention run per sequence, on its own state. Rows batched
        together may round differently from rows alone where ggml picks another kernel for more
        rows (the backbone's probe decides what it batches). A DeltaNet layer is all one ggml
        graph (:func:`p2pswarm.engine.arch.qwen35moe.deltanet_graph.deltanet_pre_moe`: the same steps in llama.cpp's
        ops, state updated in place); :meth:`_layer_graph` says when. So is a gated-attention layer
        (:func:`p2pswarm.engine.arch.qwen35moe.graph.gated_attention`: every sequence's KV write and
        attention on its own cache).

        ``front``: layer ``il - 1``'s experts and ``layer_out`` (``h + (moe + shared)``, the shared
        expert from that layer's graph) computed in front of the layer, in the same graph
        (:meth:`~p2pswarm.engine.arch.common.LayerByGraph.layer_in_after`)."""
        if sum(n for _, _, n in segments) != h.shape[0]:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows, h has {h.shape[0]}")
        groups = _chunks(segments)
        stepped = {j for j, (_, _, _, one_by_one) in enumerate(groups) if one_by_one}
        if self.recurrent[il]:
            lw = self._layer_graph(il, segments)
            if lw is not None:
                self.layer_graph_calls += 1
                snaps: dict[int, list] = {j: [] for j in stepped}
                got = ggml_layers.deltanet_pre_moe(self, il, lw, np.ascontiguousarray(h, dtype=F32),
                                                   [(st.extra[il], n) for st, _, n, _ in groups], snaps, front)
                for j, ck in snaps.items():
                    groups[j][0].checkpoints[il] = ck
                return got
        elif all(n > 0 for _, _, n in segments):
            runner = self._attention_graph_runner()
            if runner is not None:  # the ggml kernel: the whole layer as one graph, ffn_input's norm too
                segs: list[tuple] = []
                for st, p0, n, one_by_one in groups:  # a chunk's positions: one decode row each
                    segs += ([(ggml_attention.KVAhead(st.kv[il], i), p0 + i, 1) for i in range(n)] if one_by_one
                             else [(st.kv[il], p0, n)])
                got = gated_attention(self, runner, il, np.ascontiguousarray(h, dtype=F32),
                                      segs, with_ffn_input=True, front=front)
                for st, _, n, one_by_one in groups:
                    if one_by_one:
                        kv = st.kv[il]
                        st.checkpoints[il] = [kv.n + i + 1 for i in range(n - 1)]
                        kv.n += n
                return got
        if stepped:
            raise ValueError(f"layer {il}: a verification chunk needs the layer's ggml graph (see chunk_verify)")
        return None

    def pieces_pre_moe(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> np.ndarray:
        """h + attention-or-DeltaNet(attn_norm(h)) by the pieces: numpy (ggml's mat-muls under the
        ggml kernel) between the kernels."""
        x = ops.rms_norm(h, self.w[f"blk.{il}.attn_norm.weight"], self.eps)
        if self.recurrent[il]:
            out = self._linear_attention_rows(il, x, [(st.extra[il], n) for st, _, n in segments])
        else:
            out = self._full_attention_rows(il, x, [(st.kv[il], pos0, n) for st, pos0, n in segments])
        return h + out

    def chunk_verify(self, il: int) -> bool:
        """Whether :meth:`pre_moe_batch` of layer ``il`` takes a speculative verification's
        positions in one call (consecutive one-row segments of one state: each position computed
        as a one-token decode step computes it, its state checkpointed after it): where the
        layer's ggml graph runs (:func:`~p2pswarm.engine.arch.qwen35moe.deltanet_graph.deltanet_pre_moe`'s stepped
        segments; :class:`~p2pswarm.engine.ggml.attention.KVAhead`). Not on the numpy/portable
        per-piece path: there a chunk's attention would multiply all its rows by the cache in one
        BLAS call (other bits than one row's) and its delta rule would take the chunked form, so
        the backbone verifies position by position there (``Backbone._pre_rounds``)."""
        if self.recurrent[il]:
            return self._layer_graph(il, []) is not None
        return self._attention_graph_runner() is not None

    #: False keeps the per-piece path (numpy between ggml graphs) under the ggml kernel too; tests
    #: compare the two.
    attention_graph = True

    def _attention_graph_runner(self):
        return ggml_attention.graph_runner(self)

    def _layer_graph(self, il: int, segments) -> "ggml_layers.DeltaNetLayerWeights | None":
        """Layer ``il``'s tensors for the one-graph DeltaNet layer (:mod:`p2pswarm.engine.arch.qwen35moe.deltanet_graph`),
        or None where the per-piece path runs instead: the numpy/portable kernels (no ggml dense
        path), a pinned ``deltanet_mode`` (the numpy forms under test), non-square states (the
        op's limit), an empty segment, a state whose memory is not ggml-aligned (a copy made
        elsewhere than :class:`~p2pswarm.engine.arch.qwen35moe.deltanet.DeltaNetState`), or a libggml without
        one of the graph's ops."""
        if (self.deltanet_mode != "auto" or self.ssm_d != self.ssm_dv or self.backend.ggml is None
                or any(n <= 0 or not ggml_layers.placeable(st.extra[il]) for st, _, n in segments)):
            return None
        return ggml_layers.deltanet_layer_weights(self, il)

    def full_attention(self, il: int, x: np.ndarray, kv: KVCache, pos0: int) -> np.ndarray:
        """Gated attention: q and its sigmoid gate interleaved head by head in attn_q; IMROPE."""
        return self._full_attention_rows(il, x, [(kv, pos0, x.shape[0])])

    def _full_attention_rows(self, il: int, x: np.ndarray, segs: list[tuple[KVCache, int, int]]) -> np.ndarray:
        w, p = self.w, f"blk.{il}."
        T, H, hd = x.shape[0], self.n_head, self.head_dim
        qg, k, v = ops.matmuls(x, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        qg = qg.reshape(T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = k.reshape(T, self.n_head_kv, hd)
        v = v.reshape(T, self.n_head_kv, hd)
        q = ops.rms_norm(q, w[p + "attn_q_norm.weight"], self.eps)
        k = ops.rms_norm(k, w[p + "attn_k_norm.weight"], self.eps)
        pos = np.concatenate([np.arange(pos0, pos0 + n) for _, pos0, n in segs])
        q = ops.rope_imrope(q, pos, self.n_rot, self.rope_base, self.rope_sections)
        k = ops.rope_imrope(k, pos, self.n_rot, self.rope_base, self.rope_sections)
        atts, at = [], 0
        for kv, pos0, n in segs:  # per sequence: its KV cache
            keys, values = kv.append(k[at:at + n], v[at:at + n])
            atts.append(ops.attention(q[at:at + n], keys, values, pos0))
            at += n
        att = (atts[0] if len(atts) == 1 else np.concatenate(atts)).reshape(T, H * hd)
        gated = att * ops.sigmoid(np.ascontiguousarray(gate).reshape(T, H * hd))
        return ops.matmul(np.ascontiguousarray(gated), w[p + "attn_output.weight"])

    def linear_attention(self, il: int, x: np.ndarray, st: deltanet.DeltaNetState) -> np.ndarray:
        """Gated DeltaNet: conv -> silu -> q, k (l2-normed), v -> delta rule -> gated RMSNorm -> out."""
        return self._linear_attention_rows(il, x, [(st, x.shape[0])])

    def _linear_attention_rows(self, il: int, x: np.ndarray, segs: list[tuple[deltanet.DeltaNetState, int]]):
        w, p = self.w, f"blk.{il}."
        T = x.shape[0]
        Hv, dv = self.ssm_hv, self.ssm_dv
        m, z, beta, alpha = ops.matmuls(x, [w[p + "attn_qkv.weight"], w[p + "attn_gate.weight"],
                                            w[p + "ssm_beta.weight"], w[p + "ssm_alpha.weight"]])  # m (T, C)
        z = z.reshape(T, Hv, dv)
        beta = ops.sigmoid(beta)  # (T, Hv)
        alpha = alpha + w[p + "ssm_dt.bias"].reshape(-1)
        g = deltanet.softplus(alpha) * w[p + "ssm_a"].reshape(-1)  # ssm_a holds -exp(A_log) already
        prepared, at = [], 0
        for st, n in segs:  # per sequence: its conv rows
            prepared.append((*self._qkv(il, m[at:at + n], st), g[at:at + n], beta[at:at + n], st))
            at += n
        o = np.concatenate(self._delta_rule(prepared)) if len(prepared) > 1 else self._delta_rule(prepared)[0]
        y = deltanet.gated_rms_norm(o, w[p + "ssm_norm.weight"].reshape(-1), z, self.eps)
        return ops.matmul(np.ascontiguousarray(y.reshape(T, Hv * dv)), w[p + "ssm_out.weight"])

    def _qkv(self, il: int, m: np.ndarray, st: deltanet.DeltaNetState):
        """One sequence's conv (carrying its rows) -> silu -> q, k (l2-normed, Hk heads), v."""
        w, p = self.w, f"blk.{il}."
        T = m.shape[0]
        d, Hk, Hv, dv = self.ssm_d, self.ssm_hk, self.ssm_hv, self.ssm_dv
        conv, new_rows = deltanet.causal_conv1d(m, st.conv, np.asarray(w[p + "ssm_conv1d.weight"]))
        st.conv[...] = new_rows  # in place: the state's aligned memory (see DeltaNetState)
        c = ops.silu(conv)
        q = deltanet.l2_norm(c[:, : Hk * d].reshape(T, Hk, d), self.eps)
        k = deltanet.l2_norm(c[:, Hk * d : 2 * Hk * d].reshape(T, Hk, d), self.eps)
        v = c[:, 2 * Hk * d :].reshape(T, Hv, dv)
        return q, k, v

    def _delta_rule(self, prepared: list[tuple]) -> list[np.ndarray]:
        """The delta rule of every sequence, each on its own state.

        With the ggml kernel (and ``deltanet_mode`` auto) all of them run as llama.cpp's
        ``ggml_gated_delta_net`` in one graph (:mod:`p2pswarm.engine.arch.qwen35moe.ggml_deltanet`: per head and
        sequence, so each sequence's bits do not depend on the others). Otherwise numpy, one
        sequence at a time: the in-place float32 step for a token, else :func:`deltanet.delta_rule`."""
        runner = self.backend.runner
        # the op takes square states only (q/k width == v width, as every Qwen3.5 has)
        if (runner is not None and self.deltanet_mode == "auto" and self.ssm_d == self.ssm_dv
                and ggml_deltanet.available(runner)):
            return ggml_deltanet.gated_delta_net(runner, prepared)
        outs = []
        for q, k, v, g, beta, st in prepared:
            Hv, Hk = self.ssm_hv, self.ssm_hk
            if Hv != Hk:  # value head h reads q/k head h mod Hk (tiled, as ggml_repeat does)
                q = np.tile(q, (1, Hv // Hk, 1))
                k = np.tile(k, (1, Hv // Hk, 1))
            if q.shape[0] == 1 and self.deltanet_mode == "auto":
                outs.append(deltanet.delta_rule_step_inplace(q, k, v, g, beta, st.S))  # decode: in place
                continue
            o, S = deltanet.delta_rule(q, k, v, g, beta, st.state(), mode=self.deltanet_mode)
            st.set_state(S)
            outs.append(o)
        return outs

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        """post_attention_norm(h): the experts' and the router's input.

        Under the ggml kernel, where the layer runs as one graph, it is ggml's RMSNorm, the op of
        that graph (row by row: the bits :meth:`layer_in` gets); otherwise numpy's."""
        runner = self._ffn_input_runner(il) if h.shape[0] else None
        if runner is not None:
            cur = ggml_attention.post_attention_norm(self, runner, il, np.ascontiguousarray(h, dtype=F32))
            if cur is not None:
                return cur
        return np.ascontiguousarray(ops.rms_norm(h, self.w[f"blk.{il}.post_attention_norm.weight"], self.eps))

    def _ffn_input_runner(self, il: int):
        """The ggml runner whose layer graph computes layer ``il``'s post_attention_norm, or None
        (the per-piece paths: their norm is numpy's, as the rest of their numerics)."""
        if not self.recurrent[il]:
            return self._attention_graph_runner()
        if (self.deltanet_mode != "auto" or self.ssm_d != self.ssm_dv
                or ggml_layers.deltanet_layer_weights(self, il) is None):
            return None
        return self.backend.runner

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router's top-k (under the ggml kernel its F32 mat-mul is the op
        :func:`~p2pswarm.engine.ggml.attention.moe_inputs` adds to the layer's graph: the same bits)."""
        return self.route_logits(il, ops.matmul(cur, self.w[f"blk.{il}.ffn_gate_inp.weight"]))

    def route_logits(self, il: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ops.route_topk(logits, self.n_expert_used)

    def shared(self, il: int, cur: np.ndarray) -> np.ndarray:
        """The shared expert, scaled by its per-token sigmoid gate; zeros if the layer has none."""
        if not self.shared_expert[il]:
            return np.zeros_like(cur)
        w, p = self.w, f"blk.{il}."
        dense = self.backend.ggml
        gate_inp = dense.f32_vector(p + "ffn_gate_inp_shexp.weight") if dense is not None else None
        if gate_inp is not None:  # the ggml kernel: the FFN and its gate in one graph, llama.cpp's ops
            got = ggml_dense.fused_swiglu(np.ascontiguousarray(cur, dtype=F32), w[p + "ffn_gate_shexp.weight"],
                                          w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"],
                                          gate_inp=gate_inp)
            if got is not None:
                return got
        s = ops.swiglu_expert(cur, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                              w[p + "ffn_down_shexp.weight"])
        # The gate's dot product row by row (numpy reduces each row of a contiguous array alone, in
        # one fixed order), not ``cur @ w``: OpenBLAS's product of (T, E) by one column gives a row
        # other bits when T changes, which kept the whole post_moe (shared expert included) per
        # sequence in the batch-invariant mode.
        wg = np.asarray(w[p + "ffn_gate_inp_shexp.weight"], dtype=F32).reshape(-1)
        gate = ops.sigmoid(np.sum(np.ascontiguousarray(cur, dtype=F32) * wg, axis=-1, keepdims=True))  # (T, 1)
        return s * gate

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        """h + (routed + shared), added in llama.cpp's order."""
        return h + (moe + self.shared(il, cur))

    def recurrent_layer(self, il: int) -> bool:
        return bool(self.recurrent[il])

    # ---- the MTP (NextN) block, a drafter (contracts.MtpModel; p2pswarm.backbone.mtp) -------
    def mtp_blocks(self) -> int:
        return self.n_layer_nextn

    def mtp_ends(self, il: int) -> MtpEnds:
        """The block's layer is a gated full-attention one whatever ``full_attention_interval`` says
        of its index (llama.cpp marks only trunk layers recurrent), with the shared expert; its head
        norm may be left out (``output_norm`` then)."""
        E, H, Hkv, hd, D = self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_expert
        head_norm, need = nextn_head_norm(self.w, il, E, optional=True)
        layer: list[tuple[str, tuple[int, ...] | None]] = [
            ("attn_norm.weight", (E,)), ("attn_q.weight", (2 * H * hd, E)), ("attn_k.weight", (Hkv * hd, E)),
            ("attn_v.weight", (Hkv * hd, E)), ("attn_output.weight", (E, H * hd)),
            ("post_attention_norm.weight", (E,)), ("ffn_gate_inp.weight", (D, E)),
            ("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,)), ("ffn_gate_inp_shexp.weight", (E,)),
            ("ffn_gate_shexp.weight", None), ("ffn_up_shexp.weight", None), ("ffn_down_shexp.weight", None)]
        return MtpEnds("token_embd.weight", self.output_name, head_norm,
                       need + [(f"blk.{il}.{name}", shape) for name, shape in layer])

    def mtp_cache(self) -> KVCache:
        return KVCache(self.n_head_kv, self.head_dim)

    def mtp_layer(self, il: int, cache: KVCache, x: np.ndarray, pos0: int, routed: Routed, *,
                  last_only: bool = False) -> np.ndarray:
        """Gated full attention on the block's cache, post_attention_norm, softmax-routed experts +
        the sigmoid-gated shared expert, with numpy's ops (a draft needs no bit-exactness, only
        llama.cpp's math; the trunk's per-layer tables, the shared expert's included, stop at the
        trunk). ``last_only``: the MoE of the last row only (contracts.MtpModel.mtp_layer)."""
        w, p = self.w, f"blk.{il}."
        a = ops.rms_norm(x, w[p + "attn_norm.weight"], self.eps)
        x = x + self._full_attention_rows(il, a, [(cache, pos0, x.shape[0])])
        if last_only:
            x = x[-1:]
        cur = np.ascontiguousarray(ops.rms_norm(x, w[p + "post_attention_norm.weight"], self.eps), dtype=F32)
        ids, wts = self.route(il, cur)
        moe = routed(cur, ids, wts)
        s = ops.swiglu_expert(cur, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                              w[p + "ffn_down_shexp.weight"])
        wg = np.asarray(w[p + "ffn_gate_inp_shexp.weight"], dtype=F32).reshape(-1)
        s = s * ops.sigmoid(np.sum(cur * wg, axis=-1, keepdims=True))
        return x + (moe + s)


def _chunks(segments: list[tuple[SequenceState, int, int]]) -> list[tuple[SequenceState, int, int, bool]]:
    """``segments`` with each run of consecutive one-row segments of one state (a verification
    chunk: successive decode positions of one sequence) as one ``(state, pos0, n, True)``."""
    out: list[list] = []  # [state, pos0, n, stepped]
    for st, p0, n in segments:
        last = out[-1] if out else None
        if last is not None and n == 1 and last[0] is st and (last[3] or last[2] == 1) and last[1] + last[2] == p0:
            last[2] += 1
            last[3] = True
        else:
            out.append([st, p0, n, False])
    return [(st, p0, n, stepped) for st, p0, n, stepped in out]
