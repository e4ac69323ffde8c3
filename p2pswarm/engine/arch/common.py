"""What the dense paths share: the dense tensors as float32 (:class:`DenseWeights`), the embedding
and the lm head (:class:`TokenEnds`), a layer's one call in and one call out composed of the
architecture's pieces (:class:`LayerByPieces`), reading a numeric hyper-parameter with a one-line
error, and checking the tensors a forward pass reads.

Why here: each architecture's loader refuses a bad GGUF at load with the key or tensor named
(never a numpy traceback mid-request); the rule for what counts as a bad key or a wrong shape is
one rule, so it lives once.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from p2pswarm.contracts import LayerIn, Routed
from p2pswarm.engine import ops
from p2pswarm.engine.backend import DenseBackend
from p2pswarm.engine.ggml.dense import QuantisedMatrix
from p2pswarm.engine.weights import to_float32
from p2pswarm.errors import ModelFormatError, UserError
from p2pswarm.model.layout import ModelLayout

F32 = np.float32


class DenseWeights:
    """Dense tensors of a model as float32, dequantised once and kept (the dense path is hot)."""

    def __init__(self, layout: ModelLayout):
        self.layout = layout
        self._by_name = {t.name: t for t in layout.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self._by_name

    def provide(self, name: str, value) -> bool:
        """Serve ``value`` (a kernel's quantised matrix) for ``name`` instead of dequantising it;
        False, and nothing changes, when ``name`` is already loaded (see :class:`p2pswarm.contracts.DenseWeights`)."""
        if name in self._cache:
            return False
        self._cache[name] = value
        return True

    def is_loaded(self, name: str) -> bool:
        return name in self._cache

    def loaded(self) -> dict:
        """What is loaded so far, by name (a read-only copy)."""
        return dict(self._cache)

    def __getitem__(self, name: str) -> np.ndarray:
        arr = self._cache.get(name)
        if arr is None:
            t = self._by_name.get(name)
            if t is None:
                raise ModelFormatError(f"{self.layout.path}: required tensor {name!r} is missing")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            arr = to_float32(t.data.reshape(-1) if t.data.ndim else t.data, t.tensor_type, shape, name)
            self._cache[name] = arr
        return arr

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's numpy shape, without loading it (the checks at load)."""
        t = self._by_name[name]
        return tuple(int(d) for d in reversed(t.shape.tolist()))


class TokenEnds:
    """The two ends every architecture shares: token ids -> embedding rows, and the final norm +
    lm head (on ggml's graph where the head is quantised). Reads ``w``, ``n_vocab``, ``eps``,
    ``output_name`` and ``backend``."""

    w: DenseWeights
    n_vocab: int
    eps: float
    output_name: str
    backend: DenseBackend

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            bad = int(tokens[(tokens < 0) | (tokens >= self.n_vocab)][0])
            raise UserError(f"token id {bad} out of range: the vocabulary has ids 0-{self.n_vocab - 1}")
        return np.ascontiguousarray(self.w["token_embd.weight"][tokens], dtype=F32)

    def output(self, h: np.ndarray) -> np.ndarray:
        W = self.w[self.output_name]
        dense = self.backend.ggml
        if dense is not None and isinstance(W, QuantisedMatrix) and W.runner is dense.runner:
            norm = dense.f32_vector("output_norm.weight")
            if norm is not None:  # the ggml kernel: the final norm and the lm head in one graph
                return W.rmatmul_t(np.ascontiguousarray(h, dtype=F32), norm=norm, eps=float(self.eps))
        x = ops.rms_norm(h, self.w["output_norm.weight"], self.eps)
        return ops.matmul(x, W).astype(F32, copy=False)


class LayerByPieces:
    """:meth:`~p2pswarm.contracts.DenseModel.layer_in` / ``layer_out`` from an architecture's
    pieces, in order: ``pre_moe_batch`` (attention, residual), ``ffn_input`` (the experts' input),
    ``route``; then ``post_moe``. An architecture whose layer runs as one ggml graph
    (qwen35moe, gpt-oss) takes the graph's results instead, and the pieces where it cannot run."""

    pre_moe_batch: Callable[[int, np.ndarray, list[tuple[Any, int, int]]], np.ndarray]
    ffn_input: Callable[[int, np.ndarray], np.ndarray]
    route: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]
    post_moe: Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

    def layer_in(self, il: int, h: np.ndarray, segments: list[tuple[Any, int, int]]) -> LayerIn:
        return self.routed(il, self.pre_moe_batch(il, h, segments))

    def routed(self, il: int, h: np.ndarray) -> LayerIn:
        """``h`` (after the attention) with its experts' input and the router's choice."""
        cur = self.ffn_input(il, h)
        ids, w = self.route(il, cur)
        return LayerIn(h, cur, ids, w)

    def layer_out(self, il: int, lin: LayerIn, moe: np.ndarray) -> np.ndarray:
        return self.post_moe(il, lin.h, lin.cur, moe)

    def layer_in_after(self, il: int, front: Any, segments: list[tuple[Any, int, int]]) -> LayerIn | None:
        """No layer graph to put the previous layer's experts in front of (see :class:`LayerByGraph`)."""
        return None

    def output_after(self, front: Any) -> np.ndarray | None:
        """Nor the lm head's (see :class:`LayerByGraph`)."""
        return None

    def decode_graph(self, token: int, state: Any, bank: Any, plan: Callable) -> np.ndarray | None:
        """Nor a whole decode step as one graph (gpt-oss: :meth:`~p2pswarm.engine.arch.gptoss.model.GptOss.decode_graph`)."""
        return None

    def moe_rows(self, il: int, h: np.ndarray, routed: Routed) -> np.ndarray:
        """The layer from ``h`` (after its attention) on, its routed experts through ``routed``:
        what an MTP block's layer does after its attention (glm4moe, deepseek2)."""
        lin = self.routed(il, h)
        return self.layer_out(il, lin, routed(lin.cur, lin.ids, lin.weights))

    def recurrent_layer(self, il: int) -> bool:
        """No recurrent layers (KV caches only), unless the architecture says otherwise."""
        return False

    def chunk_verify(self, il: int) -> bool:
        """No verification chunk in one call: the per-piece path's attention would multiply a
        chunk's rows by the cache in one BLAS call (other bits than one row's)."""
        return False


class LayerByGraph(LayerByPieces):
    """An architecture whose layer runs as ONE ggml graph where it can (qwen35moe, gpt-oss under
    the ggml kernel): the graph also computes the experts' input (post_attention_norm), the
    router's logits and a shared expert, and :meth:`layer_in` hands them on in its
    :class:`~p2pswarm.contracts.LayerIn`; elsewhere the pieces run (numpy between the kernels).

    The architecture provides ``graph_layer(il, h, segments)`` (``(h, cur, {"logits", "shared"}
    where computed)``, or None where the graph does not run), ``pieces_pre_moe(il, h, segments)``
    and ``route_logits(il, logits)`` (its router from the logits on)."""

    graph_layer: Callable[[int, np.ndarray, list[tuple[Any, int, int]]], tuple[np.ndarray, np.ndarray, dict] | None]
    pieces_pre_moe: Callable[[int, np.ndarray, list[tuple[Any, int, int]]], np.ndarray]
    route_logits: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]

    def pre_moe(self, il: int, h: np.ndarray, state: Any, pos0: int) -> np.ndarray:
        return self.pre_moe_batch(il, h, [(state, pos0, h.shape[0])])

    def pre_moe_batch(self, il: int, h: np.ndarray, segments: list[tuple[Any, int, int]]) -> np.ndarray:
        """The layer up to its experts' input for the rows of several sequences (``(state, pos0, n)``
        each, in order): the graph's ``h``, or the pieces'. With one segment exactly :meth:`pre_moe`."""
        got = self.graph_layer(il, h, segments)
        return got[0] if got is not None else self.pieces_pre_moe(il, h, segments)

    #: whether ``graph_layer`` takes ``front`` (:meth:`layer_in_after`)
    experts_in_front = False

    def layer_in(self, il: int, h: np.ndarray, segments: list[tuple[Any, int, int]]) -> LayerIn:
        got = self.graph_layer(il, h, segments)
        if got is None:
            return self.routed(il, self.pieces_pre_moe(il, h, segments))
        return self._graph_in(il, got)

    def layer_in_after(self, il: int, front: Any, segments: list[tuple[Any, int, int]]) -> LayerIn | None:
        """``layer_in(il, layer_out(il - 1, lin, moe), segments)`` as ONE graph, the previous layer's
        routed experts included (``front``: an :class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront`,
        every expert on the backbone): the same bits as the two calls and the bank's between them.
        None where the architecture or the kernel does not run it (the caller then makes the calls)."""
        if not self._fits(front):
            return None
        got = self.graph_layer(il, front.h, segments, front)  # type: ignore[call-arg]
        return None if got is None else self._graph_in(il, got)

    def output_after(self, front: Any) -> np.ndarray | None:
        """``output(layer_out(L - 1, lin, moe))`` with the last layer's experts, combine and
        ``layer_out`` in front of the final norm and the lm head, ONE graph (``front`` as
        :meth:`layer_in_after`'s): the same bits. None where not (the head not on ggml's graph)."""
        W = self.w[self.output_name]  # type: ignore[attr-defined]
        dense = self.backend.ggml  # type: ignore[attr-defined]
        if not self._fits(front) or not isinstance(W, QuantisedMatrix) or W.runner is not dense.runner:
            return None
        norm = dense.f32_vector("output_norm.weight")
        return None if norm is None else W.rmatmul_t(front.h, norm=norm, eps=float(self.eps), front=front)  # type: ignore[attr-defined]

    def _fits(self, front: Any) -> bool:
        """Whether ``front`` computes this architecture's ``layer_out`` (``h + moe``, or ``h + (moe +
        shared)`` with the layer's shared expert from its graph) on this process's libggml."""
        runner = self.backend.runner  # type: ignore[attr-defined]
        return (self.experts_in_front and runner is not None and front.bank.lib is runner.lib
                and (front.shared is not None) == bool(self.shared_expert[front.layer]))  # type: ignore[attr-defined]

    def _graph_in(self, il: int, got: tuple[np.ndarray, np.ndarray, dict]) -> LayerIn:
        h, cur, extras = got
        logits = extras.pop("logits", None)
        ids, w = self.route_logits(il, logits) if logits is not None else self.route(il, cur)
        return LayerIn(h, cur, ids, w, extras)



def dense_or_shared_ffn(w: Any, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray, *, dense: bool,
                        shared: bool) -> np.ndarray:
    """The residual after a layer's FFN, in llama.cpp's order (deepseek2, glm4moe): a leading dense
    layer's h + its FFN (``moe`` ignored), else h + (routed + shared expert), or h + routed where
    the model has no shared expert."""
    p = f"blk.{il}."
    if dense:
        return h + ops.swiglu_expert(cur, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    if not shared:
        return h + moe
    return h + (moe + ops.swiglu_expert(cur, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
                                        w[p + "ffn_down_shexp.weight"]))


def neox_attention(w: Any, il: int, h: np.ndarray, caches: list[tuple[Any, int, int]],
                   qkv: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]], *,
                   eps: float, n_rot: int, rope_base: float, n_head: int, head_dim: int) -> np.ndarray:
    """``h + attn_output(attention(q, k, v))`` of one GQA layer with NEOX RoPE, for the rows of
    several sequences (``h`` holds the ``n`` rows of each ``(kv cache, pos0, n)`` of ``caches``, in
    order): the norm, ``qkv(il, x)`` (the architecture's projections, q/k norms, biases: before
    RoPE) and RoPE over all rows, then each sequence's cache and attention. qwen3moe's and
    glm4moe's layers, and glm4moe's MTP block on its own cache.

    Why a function of explicit parameters: two architectures and a drafter share it, and none of
    them borrows another's method for it."""
    if sum(n for _, _, n in caches) != h.shape[0]:
        raise ValueError(f"segments cover {sum(n for _, _, n in caches)} rows, h has {h.shape[0]}")
    p, T = f"blk.{il}.", h.shape[0]
    x = ops.rms_norm(h, w[p + "attn_norm.weight"], eps)
    q, k, v = qkv(il, x)
    pos = np.concatenate([np.arange(pos0, pos0 + n) for _, pos0, n in caches])
    q = ops.rope_neox(q, pos, n_rot, rope_base)
    k = ops.rope_neox(k, pos, n_rot, rope_base)
    atts, at = [], 0
    for kv, pos0, n in caches:
        keys, values = kv.append(k[at:at + n], v[at:at + n])
        atts.append(ops.attention(q[at:at + n], keys, values, pos0))
        at += n
    att = (atts[0] if len(atts) == 1 else np.concatenate(atts)).reshape(T, n_head * head_dim)
    return h + ops.matmul(np.ascontiguousarray(att), w[p + "attn_output.weight"])


def nextn_head_norm(w: Any, il: int, n_embd: int, *, optional: bool) -> tuple[str, list[tuple[str, tuple[int, ...] | None]]]:
    """An MTP block's head norm and what to check of it: ``blk.il.nextn.shared_head_norm``, or
    ``output_norm`` where the architecture lets a file leave it out (``optional``: llama.cpp's
    qwen35moe and deepseek2 loaders) and the file does."""
    name = f"blk.{il}.nextn.shared_head_norm.weight"
    if optional and not w.has(name):
        return "output_norm.weight", []
    return name, [(name, (n_embd,))]

def model_error(layout):
    """``bad(msg)``: a :class:`~p2pswarm.errors.ModelFormatError` that names ``layout``'s file."""
    return lambda msg: ModelFormatError(f"{layout.path}: {msg}")


def number_reader(layout, arch: str):
    """``num(key, default=None, kind=int)``: hyper-parameter ``key`` of ``layout`` as ``kind``;
    required when ``default`` is None. A string, list, bool or missing value, or a fraction where
    an integer is wanted, is a :class:`~p2pswarm.errors.ModelFormatError` naming ``arch.key``."""

    def num(key: str, default=None, kind=int):
        v = layout.hparam(key, default, required=default is None)
        if isinstance(v, (bool, list, str, bytes)) or v is None:
            raise ModelFormatError(f"{layout.path}: key {arch}.{key} must be a number, got {v!r}")
        if kind is int and float(v) != int(v):
            raise ModelFormatError(f"{layout.path}: key {arch}.{key} must be an integer, got {v!r}")
        return kind(v)

    return num


def check_tensors(model, need: list[tuple[str, tuple[int, ...]]]) -> None:
    """Every ``(name, shape)`` of ``need`` present in ``model.w`` with that shape (numpy order; a
    1-D tensor may be stored with trailing unit dims), else a one-line error naming the first
    that is not."""
    for name, shape in need:
        if not model.w.has(name):
            raise ModelFormatError(f"{model.layout.path}: required tensor {name!r} is missing")
        got = tuple(model.w.shape(name))
        if got != shape and not (len(shape) == 1 and int(np.prod(got)) == shape[0]):
            raise ModelFormatError(f"{model.layout.path}: tensor {name!r} has shape {got}, expected {shape}")
