"""The dense path of ``gpt-oss`` (OpenAI's gpt-oss MoE; llama.cpp's ``LLM_ARCH_OPENAI_MOE``).

Same contract as :mod:`p2pswarm.engine.arch.qwen3moe` (``layer_in``, ``layer_out``), so the
routed experts split across workers the same way. What differs (as
llama.cpp's ``src/models/openai-moe.cpp`` and ``build_moe_ffn`` compute it):

* Attention has biases on q, k, v and the output projection, no q/k norms, and one learned
  *sink* logit per head: it joins each row's softmax (in the max and the denominator) but carries
  no value, so a head can attend to "nothing" (:func:`attention_sinks`).
* Layers alternate sliding-window and full attention: with ``attention.sliding_window_pattern``
  absent, layer ``il`` slides when ``il % 2 == 0`` (llama.cpp's ``set_swa_pattern(2)``). A query at
  position ``p`` then sees keys ``j`` with ``p - j < n_swa`` (``is_masked_swa``, standard type).
  The window is applied in the mask, as llama.cpp masks; a sliding layer's cache
  (:class:`WindowKVCache`) drops the positions no later query can see, so it stays bounded by about
  twice the window however long the sequence (a full layer's keeps every position).
* RoPE is NEOX with YaRN scaling (``rope.scaling.*``; :func:`yarn_neox_tables`), the same on both
  kinds of layer unless ``rope.freq_base_swa`` says otherwise.
* The experts' input is ``post_attention_norm(h)``; there is no shared expert.
* The router has a bias and gates by *softmax over the selected top-k logits*
  (``SOFTMAX_WEIGHT``): top-k of the raw (biased) logits, then a softmax of those k.
* The experts themselves (biases, the clamped SwiGLU ``swiglu_oai``) are the worker's: see
  :mod:`p2pswarm.engine.experts.expert_fn`.
"""
from __future__ import annotations

import math

import numpy as np

from p2pswarm.engine.ggml import attention as ggml_attention
from p2pswarm.engine import ops
from p2pswarm.engine.arch.common import DenseWeights, LayerByGraph, TokenEnds, check_tensors, model_error, number_reader
from p2pswarm.engine.arch.gptoss.graph import decode_step, sink_attention
from p2pswarm.engine.backend import NUMPY, DenseBackend
from p2pswarm.engine.state import KVCache, SequenceState
from p2pswarm.errors import ModelFormatError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32

#: rope.scaling.type values llama.cpp knows and what they do here
ROPE_SCALING = ("none", "linear", "yarn")


class GptOss(TokenEnds, LayerByGraph):
    """gpt-oss: GQA attention with biases and sinks, alternating sliding-window / full layers, YaRN
    RoPE; biased router, softmax over the selected experts; no shared expert.

    Under the ggml kernel an attention layer is one ggml graph, llama.cpp's ops
    (:func:`p2pswarm.engine.arch.gptoss.graph.sink_attention`), which also computes the experts'
    input and the router's logits (:meth:`layer_in` takes them from it);
    otherwise numpy computes it (:func:`attention_sinks`), between the kernel's mat-muls."""

    arch = "gpt-oss"
    #: False keeps the numpy path under the ggml kernel too (tests compare the two)
    attention_graph = True
    #: layer calls that ran as one graph (tests assert the graph path ran)
    layer_graph_calls = 0
    #: the previous layer's experts and residual may run in front of a layer's graph (post_moe is h + moe)
    experts_in_front = True
    #: False: a one-sequence decode step runs graph by graph (:meth:`decode_graph`; tests compare the two)
    decode_as_one_graph = True

    def __init__(self, layout: ModelLayout, backend: DenseBackend = NUMPY):
        self.backend = backend  # numpy's dense path, or ggml's graphs: chosen at load (engine.backend)
        self.layout = layout
        bad, num = model_error(layout), number_reader(layout, self.arch)

        self.n_layer = num("block_count")
        self.n_embd = num("embedding_length")
        self.n_ctx_train = num("context_length", 4096)
        self.n_head = num("attention.head_count")
        self.n_head_kv = num("attention.head_count_kv", self.n_head)
        self.head_dim = num("attention.key_length", self.n_embd // max(self.n_head, 1))
        v_len = num("attention.value_length", self.head_dim)
        self.n_rot = num("rope.dimension_count", self.head_dim)
        self.eps = num("attention.layer_norm_rms_epsilon", kind=float)
        self.n_expert = num("expert_count")
        self.n_expert_used = num("expert_used_count")
        self.n_ff_exp = num("expert_feed_forward_length")
        self.n_swa = num("attention.sliding_window")
        self.w_scale = num("expert_weights_scale", 0.0, kind=float)
        for name, v in (("block_count", self.n_layer), ("embedding_length", self.n_embd),
                        ("attention.head_count", self.n_head), ("attention.head_count_kv", self.n_head_kv),
                        ("attention.key_length", self.head_dim), ("expert_count", self.n_expert),
                        ("expert_used_count", self.n_expert_used), ("expert_feed_forward_length", self.n_ff_exp),
                        ("attention.sliding_window", self.n_swa), ("attention.layer_norm_rms_epsilon", self.eps)):
            if v <= 0:
                raise bad(f"key {self.arch}.{name} must be positive, got {v}")
        if self.n_head % self.n_head_kv:
            raise bad(f"key {self.arch}.attention.head_count {self.n_head} is not a multiple of "
                      f"attention.head_count_kv {self.n_head_kv}")
        if v_len != self.head_dim:
            raise bad(f"key {self.arch}.attention.value_length {v_len} != attention.key_length {self.head_dim} "
                      "(unsupported)")
        if self.n_rot != self.head_dim:
            raise bad(f"key {self.arch}.rope.dimension_count {self.n_rot} != attention.key_length {self.head_dim} "
                      "(gpt-oss rotates whole heads)")
        if self.n_expert_used > self.n_expert:
            raise bad(f"key {self.arch}.expert_used_count {self.n_expert_used} exceeds expert_count {self.n_expert}")
        self.swa = self._swa_layers()
        self._rope_params(num)
        self._rope_memo: dict = {}  # (positions, base) -> yarn_neox_tables (_rope_tables)

        self.w = DenseWeights(layout)
        self.shared_expert = [False] * self.n_layer  # none (the layer graph's moe_inputs reads it)
        self.output_name = "output.weight"
        self.n_vocab = int(layout.tensor("token_embd.weight").shape[1])
        self._check_tensors()

    # ---- model description ------------------------------------------------------------------
    def _swa_layers(self) -> list[bool]:
        """Which layers slide: ``attention.sliding_window_pattern`` as a per-layer bool array, or as
        an integer n (layer il slides when ``il % n < n - 1``; 0: all), default 2 (even layers)."""
        pat = self.layout.hparam("attention.sliding_window_pattern", 2)
        if isinstance(pat, list):
            if len(pat) != self.n_layer or not all(isinstance(p, (bool, int)) for p in pat):
                raise ModelFormatError(f"{self.layout.path}: key {self.arch}.attention.sliding_window_pattern must "
                                       f"list {self.n_layer} booleans, got {pat!r}")
            return [bool(p) for p in pat]
        if isinstance(pat, bool) or not isinstance(pat, int) or pat < 0:
            raise ModelFormatError(f"{self.layout.path}: key {self.arch}.attention.sliding_window_pattern must be "
                                   f"a non-negative integer or a per-layer array, got {pat!r}")
        return [pat == 0 or il % pat < pat - 1 for il in range(self.n_layer)]

    def _rope_params(self, num) -> None:
        """RoPE's base, frequency scale and YaRN factors, as llama.cpp's loader and context derive them."""
        path = self.layout.path
        self.rope_base = num("rope.freq_base", 10000.0, kind=float)
        self.rope_base_swa = num("rope.freq_base_swa", self.rope_base, kind=float)
        kind = self.layout.hparam("rope.scaling.type", "linear")
        if kind not in ROPE_SCALING:
            raise ModelFormatError(f"{path}: key {self.arch}.rope.scaling.type {kind!r} is not supported "
                                   f"(supported: {', '.join(ROPE_SCALING)})")
        factor = num("rope.scaling.factor", 0.0, kind=float)
        if factor < 0:
            raise ModelFormatError(f"{path}: key {self.arch}.rope.scaling.factor must not be negative, got {factor}")
        self.freq_scale = 1.0 if kind == "none" or factor == 0.0 else float(F32(1.0) / F32(factor))
        self.n_ctx_orig = num("rope.scaling.original_context_length", self.n_ctx_train)
        if self.n_ctx_orig <= 0:
            raise ModelFormatError(f"{path}: key {self.arch}.rope.scaling.original_context_length must be positive")
        self.ext_factor = 1.0 if kind == "yarn" else 0.0
        attn = F32(1.0)
        if self.ext_factor != 0.0:
            f = F32(1.0) / F32(self.freq_scale)
            mscale = F32(0.1) * F32(math.log(f)) + F32(1.0) if f > 1.0 else F32(1.0)
            attn = mscale * (F32(1.0) / (F32(1.0) + F32(0.1) * F32(math.log(f))))
        self.attn_factor = float(attn * F32(num("rope.scaling.attn_factor", 1.0, kind=float)))
        self.beta_fast, self.beta_slow = 32.0, 1.0

    def _check_tensors(self) -> None:
        """Every tensor the forward pass reads, present and of the right shape (one line naming the
        first that is not)."""
        E, V, H, Hkv, hd, D = self.n_embd, self.n_vocab, self.n_head, self.n_head_kv, self.head_dim, self.n_expert
        need = [("token_embd.weight", (V, E)), ("output_norm.weight", (E,)), ("output.weight", (V, E))]
        for il in range(self.n_layer):
            p = f"blk.{il}."
            need += [(p + "attn_norm.weight", (E,)), (p + "post_attention_norm.weight", (E,)),
                     (p + "attn_q.weight", (H * hd, E)), (p + "attn_k.weight", (Hkv * hd, E)),
                     (p + "attn_v.weight", (Hkv * hd, E)), (p + "attn_output.weight", (E, H * hd)),
                     (p + "attn_output.bias", (E,)), (p + "attn_sinks.weight", (H,)),
                     (p + "ffn_gate_inp.weight", (D, E)), (p + "ffn_gate_inp.bias", (D,))]
            for n, width in (("attn_q.bias", H * hd), ("attn_k.bias", Hkv * hd), ("attn_v.bias", Hkv * hd)):
                if self.w.has(p + n):  # optional in llama.cpp's loader
                    need.append((p + n, (width,)))
            if il not in self.layout.expert_tensors:
                raise ModelFormatError(f"{self.layout.path}: layer {il} has no routed-expert tensors "
                                       f"(blk.{il}.ffn_*_exps.weight)")
            kinds = self.layout.expert_tensors[il]
            for kind in ("gate_bias", "up_bias", "down_bias"):
                if kind not in kinds:
                    raise ModelFormatError(f"{self.layout.path}: required tensor "
                                           f"'blk.{il}.ffn_{kind[:-5]}_exps.bias' is missing")
        check_tensors(self, need)

    # ---- per sequence -----------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState(kv={il: WindowKVCache(self.n_head_kv, self.head_dim, self.n_swa) if self.swa[il]
                                 else KVCache(self.n_head_kv, self.head_dim) for il in range(self.n_layer)})

    # ---- the layer pieces (embed, output: common.TokenEnds) ---------------------------------
    def _vec(self, name: str) -> np.ndarray:
        return np.asarray(self.w[name], dtype=F32).reshape(-1)

    def pieces_pre_moe(self, il: int, h: np.ndarray, segments: list[tuple[SequenceState, int, int]]) -> np.ndarray:
        """``h + attn_output(attention(attn_norm(h))) + bias`` for the rows of several sequences
        (``(state, pos0, n)`` each, in order) by numpy (the kernel's mat-muls between):
        projections over all rows, KV cache and attention per sequence."""
        w, p = self.w, f"blk.{il}."
        T, H, Hkv, hd = h.shape[0], self.n_head, self.n_head_kv, self.head_dim
        x = ops.rms_norm(h, w[p + "attn_norm.weight"], self.eps)
        q, k, v = ops.matmuls(x, [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        for name, t in (("attn_q.bias", q), ("attn_k.bias", k), ("attn_v.bias", v)):
            if w.has(p + name):
                t += self._vec(p + name)
        q = q.reshape(T, H, hd)
        k = k.reshape(T, Hkv, hd)
        v = v.reshape(T, Hkv, hd)
        pos = np.concatenate([np.arange(pos0, pos0 + n) for _, pos0, n in segments])
        cos, sin = self._rope_tables(pos, self.rope_base_swa if self.swa[il] else self.rope_base)
        q = ops.rotate_neox_cs(q, cos, sin, self.n_rot)
        k = ops.rotate_neox_cs(k, cos, sin, self.n_rot)
        sinks = self._vec(p + "attn_sinks.weight")
        window = self.n_swa if self.swa[il] else None
        atts, at = [], 0
        for state, pos0, n in segments:
            kv = state.kv[il]
            keys, values = kv.append(k[at:at + n], v[at:at + n])
            atts.append(attention_sinks(q[at:at + n], keys, values, pos0, sinks, window,
                                        k_pos0=getattr(kv, "first", 0)))
            if window is not None and isinstance(kv, WindowKVCache):
                kv.trim()
            at += n
        att = (atts[0] if len(atts) == 1 else np.concatenate(atts)).reshape(T, H * hd)
        out = ops.matmul(np.ascontiguousarray(att), w[p + "attn_output.weight"]) + self._vec(p + "attn_output.bias")
        return h + out

    def _graph_runner(self):
        return ggml_attention.graph_runner(self, sinks=True)

    def graph_layer(self, il: int, h: np.ndarray, segments, front=None):
        """:meth:`pre_moe_batch` as one ggml graph: ``(h, post_attention_norm(h), {"logits"})``;
        None where it does not run (the numpy/portable kernels, an empty segment). A sliding
        layer's caches are trimmed after it, as on the numpy path. ``front``: layer ``il - 1``'s
        experts and residual (``post_moe``: h + moe) computed in front, in the same graph
        (:meth:`~p2pswarm.engine.arch.common.LayerByGraph.layer_in_after`)."""
        if sum(n for _, _, n in segments) != h.shape[0]:
            raise ValueError(f"segments cover {sum(n for _, _, n in segments)} rows, h has {h.shape[0]}")
        runner = self._graph_runner()
        if runner is None or not all(n > 0 for _, _, n in segments):
            return None
        slides = self.swa[il]
        caches = [st.kv[il] for st, _, _ in segments]
        h, cur, extras = sink_attention(
            self, runner, il, np.ascontiguousarray(h, dtype=F32),
            [(kv, p0, n) for kv, (_, p0, n) in zip(caches, segments)],
            window=self.n_swa if slides else None, rope_base=self.rope_base_swa if slides else self.rope_base,
            front=front)
        if slides:
            for kv in caches:
                if isinstance(kv, WindowKVCache):
                    kv.trim()
        self.layer_graph_calls += 1
        return h, cur, extras

    def decode_graph(self, token: int, state: SequenceState, bank, counted) -> np.ndarray | None:
        """One decode step of one sequence as ONE ggml graph, every expert on ``bank``
        (:func:`~p2pswarm.engine.arch.gptoss.graph.decode_step`): its logits (1, n_vocab), the bits
        of the per-layer calls; None where it does not run. A sliding layer's cache is trimmed
        after it, as :meth:`graph_layer` trims it."""
        runner = self._graph_runner() if self.decode_as_one_graph and self.experts_in_front else None
        logits = decode_step(self, runner, bank, token, state, counted) if runner is not None else None
        if logits is not None:
            for il in range(self.n_layer):
                kv = state.kv[il]
                if self.swa[il] and isinstance(kv, WindowKVCache):
                    kv.trim()
            self.layer_graph_calls += self.n_layer
        return logits

    def _rope_tables(self, pos: np.ndarray, base: float) -> tuple[np.ndarray, np.ndarray]:
        """:func:`yarn_neox_tables` for these positions, made once for q and k and for every layer of
        a step with the same base (a few memoised: the positions repeat across a step's layers)."""
        memo = self._rope_memo
        key = (pos.tobytes(), base)
        got = memo.get(key)
        if got is None:
            if len(memo) >= 4:
                memo.clear()
            got = memo[key] = yarn_neox_tables(pos, self.n_rot, base, self.freq_scale, self.ext_factor,
                                               self.attn_factor, self.beta_fast, self.beta_slow, self.n_ctx_orig)
        return got

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        """post_attention_norm(h): ggml's where the layer runs as one graph (its op, row by row: the
        bits :meth:`layer_in` gets); numpy's otherwise."""
        runner = self._graph_runner() if h.shape[0] else None
        if runner is not None:
            cur = ggml_attention.post_attention_norm(self, runner, il, np.ascontiguousarray(h, dtype=F32))
            if cur is not None:
                return cur
        return np.ascontiguousarray(ops.rms_norm(h, self.w[f"blk.{il}.post_attention_norm.weight"], self.eps))

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the biased router logits, weights a softmax over those k (``SOFTMAX_WEIGHT``).
        (:meth:`layer_in` takes the logits before the bias from the layer's graph: the same op as
        ``ops.matmul`` here, so the same bits.)"""
        return self.route_logits(il, ops.matmul(cur, self.w[f"blk.{il}.ffn_gate_inp.weight"]))

    def route_logits(self, il: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.route_biased(logits + self._vec(f"blk.{il}.ffn_gate_inp.bias"))

    def route_biased(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router from its biased logits on (:meth:`decode_graph` adds the bias in its graph)."""
        return route_softmax_weight(logits.astype(F32, copy=False), self.n_expert_used, self.w_scale)

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        return h + moe


class WindowKVCache(KVCache):
    """A sliding-window layer's KV cache: only the positions a later query can still see.

    Why: a query at position ``p`` sees keys ``j`` with ``p - j < window``, so once the cache holds
    positions up to ``first + n - 1`` every later query needs only the last ``window - 1`` of them.
    :meth:`trim` (after each call's attention) drops the rest once ``2 * window`` are held: a copy
    of ``window - 1`` rows every ``window + 1`` positions, and memory bounded by about twice the
    window (a long prefill's larger buffer is given back) instead of growing with the sequence.
    ``first`` is the position of row 0 (:func:`attention_sinks`' ``k_pos0``). The masked-out keys
    it drops had softmax weight exactly 0, so the attention is the same function; float32 sums
    over fewer (zero) terms can round differently in the last bit."""

    def __init__(self, n_head_kv: int, head_dim: int, window: int, capacity: int = 64):
        super().__init__(n_head_kv, head_dim, capacity)
        self.window = window
        self.first = 0

    def checkpoint(self):
        """A copy of the rows held (at most about two windows) and where they start: :meth:`trim`
        moves rows, so the position count alone cannot undo a step."""
        return self.n, self.first, self.k[: self.n].copy(), self.vt[..., : self.n].copy()

    def restore(self, snap) -> None:
        n, first, k, vt = snap
        self.n = 0
        self.reserve(n)
        self.k[:n] = k
        self.vt[..., :n] = vt
        self.n, self.first = n, first

    def trim(self) -> None:
        keep = self.window - 1
        if self.n < 2 * self.window:
            return
        drop = self.n - keep  # > keep: the copy's source and destination do not overlap
        k, vt = self.k, self.vt
        if k.shape[0] > 4 * self.window:  # a long prefill grew the buffer: give it back
            small = KVCache(k.shape[1], k.shape[2], 2 * self.window)
            self.k, self.vt = small.k, small.vt
        self.k[:keep] = k[drop:self.n]
        self.vt[..., :keep] = vt[..., drop:self.n]
        self.first += drop
        self.n = keep


# ---- the numerics -------------------------------------------------------------------------------
def route_softmax_weight(logits: np.ndarray, k: int, w_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, weights)``: the k largest logits (descending; ties keep the lower id first), their
    weights ``softmax`` over those k only, scaled by ``w_scale`` unless it is 0 or 1."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    sel = logits[np.arange(logits.shape[0])[:, None], order]  # take_along_axis's values, fewer calls
    weights = ops.softmax(sel, axis=-1).astype(F32, copy=False)
    if w_scale not in (0.0, 1.0):
        weights = weights * F32(w_scale)
    return order.astype(np.int64), weights


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml's ``ggml_rope_yarn_corr_dims``: the first and last rotary pair YaRN blends, in float32."""
    def dim(beta: float) -> float:
        return float(F32(n_dims) * F32(math.log(F32(n_ctx_orig) / (F32(beta) * F32(2 * math.pi))))
                     / (F32(2) * F32(math.log(base))))

    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def yarn_neox_tables(positions: np.ndarray, n_rot: int, base: float, freq_scale: float, ext_factor: float,
                     attn_factor: float, beta_fast: float, beta_slow: float,
                     n_ctx_orig: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), float32 (T, 1, n_rot / 2), of NEOX RoPE with YaRN: pair ``i`` turns by a blend of
    the interpolated angle ``freq_scale * theta`` and the original ``theta`` (the ramp between the
    correction dims), and cos/sin are scaled by ``attn_factor * (1 + 0.1 ln(1/freq_scale))`` when
    YaRN is on. With ``freq_scale`` 1 and ``ext_factor`` 0 this is plain :func:`ops.rope_neox`'s.
    Why apart from the rotation: q and k, and every layer of a step, turn by the same tables."""
    half = n_rot // 2
    inv = np.power(np.float64(base), -2.0 * np.arange(half, dtype=np.float64) / n_rot)
    extrap = positions.astype(np.float64)[:, None] * inv[None, :]  # (T, half)
    theta = freq_scale * extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow)
        y = (np.arange(half, dtype=np.float64) - low) / max(0.001, high - low)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        theta = theta * (1.0 - ramp) + extrap * ramp
        mscale = float(F32(mscale) * (F32(1.0) + F32(0.1) * F32(math.log(1.0 / freq_scale))))
    cos, sin = np.cos(theta).astype(F32), np.sin(theta).astype(F32)
    if mscale != 1.0:
        cos *= F32(mscale)
        sin *= F32(mscale)
    return cos[:, None, :], sin[:, None, :]


def attention_sinks(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos0: int, sinks: np.ndarray,
                    window: int | None, k_pos0: int = 0) -> np.ndarray:
    """Causal GQA attention whose softmax rows each have one more logit, the head's sink (in the max
    and the denominator, no value: ggml's ``soft_max_add_sinks``), and, with ``window``, only the
    keys ``j`` with ``p - j < window`` for a query at position ``p`` (llama.cpp's SWA mask).

    q: (T, H, hd) for positions q_pos0..; k, v: (S, Hkv, hd) for positions k_pos0..k_pos0+S-1 (a
    trimmed sliding-window cache starts after 0); sinks (H,)."""
    T, H, _ = q.shape
    S, Hkv, _ = k.shape
    group = H // Hkv
    scores = ops.gqa_scores(q, k)  # (Hkv, group * T, S)
    # a key after the first query, or one out of the last query's window: else nothing is masked
    # (a decode row at the cache's end sees every key), and the mask is not built
    if k_pos0 + S - 1 > q_pos0 or (window is not None and q_pos0 + T - 1 - k_pos0 >= window):
        qpos = q_pos0 + np.tile(np.arange(T), group)
        kpos = k_pos0 + np.arange(S)[None, :]
        masked = kpos > qpos[:, None]
        if window is not None:
            masked |= qpos[:, None] - kpos >= window
        scores = np.where(masked[None], F32(-np.inf), scores)
    sink = np.repeat(sinks.astype(F32).reshape(Hkv, group), T, axis=1)[:, :, None]  # (Hkv, group*T, 1)
    m = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    e = np.exp(scores - m)
    e /= e.sum(axis=-1, keepdims=True, dtype=np.float64).astype(F32) + np.exp(sink - m)
    return ops.gqa_values(e, v, T)
