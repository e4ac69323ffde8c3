"""The interfaces the parts of p2pswarm meet at, as :class:`typing.Protocol` s.

Why in code: they used to live in prose ("the same interface as ExpertBank"). A new kernel, a new
architecture or a new transport implements one of these; nothing else has to know which one it
got. The protocols are ``runtime_checkable`` so a test (``tests/test_contracts.py``) can check
that every implementation has every member; mypy (default mode, ``tests/test_typecheck.py``)
checks the packages that use them.

- :class:`ExpertBank`: computes routed experts (numpy, ggml and portable kernels; a worker and the
  backbone's fallback replica hold one). Made by :func:`p2pswarm.engine.kernels.make_bank`.
- :class:`DenseModel`: one architecture's dense path (attention/DeltaNet, norms, router, lm head),
  one call into each layer (:class:`LayerIn`) and one out; the backbone's layer loop (:class:`p2pswarm.backbone.serving.runner.Backbone`) drives it. Made by
  :func:`p2pswarm.engine.arch.load_dense`.
- :class:`MtpModel`: a dense path that also runs its file's MTP (NextN) block (the drafter of
  ``--speculate mtp``); the capability is the class implementing it.
- :class:`DenseWeights`: the dense tensors a model reads by name, which the ggml backend replaces
  by its own quantised matrices (:meth:`p2pswarm.engine.backend.DenseBackend.take`, at load).
- :class:`Owner`: something the dispatcher sends rows to (the local replica, an in-process
  worker, a TCP or libp2p worker), with what the dispatcher and the status page read of it
  (:class:`OwnerStatus`). Implementations subclass it for the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

#: what a routed expert computes (:mod:`p2pswarm.engine.experts.expert_fn`): the file format's
#: table says it per architecture (``model.layout.MOE_ARCHITECTURES``), every expert kernel
#: computes it or refuses the model
SWIGLU = "swiglu"
SWIGLU_OAI = "swiglu_oai"

#: ``[(expert, row indices into cur), ...]``: the rows each expert of one layer must compute.
Groups = list[tuple[int, np.ndarray]]


@runtime_checkable
class ExpertBank(Protocol):
    """Routed experts of some layers and an expert range.

    ``kernel`` names the arithmetic (it goes into the handshake: two nodes work together only if
    :func:`p2pswarm.engine.kernels.compatible` says their kernels agree bit for bit)."""

    kernel: str

    def holds(self, layer: int, expert: int) -> bool:
        """Whether this bank computes expert ``expert`` of layer ``layer``."""
        ...

    def forward(self, layer: int, expert: int, rows: np.ndarray) -> np.ndarray:
        """One expert's output for ``rows`` (n, n_embd) float32."""
        ...

    def forward_groups(self, layer: int, rows: np.ndarray, groups: Groups) -> list[np.ndarray]:
        """Outputs per group, in the order of ``groups``."""
        ...


@runtime_checkable
class DenseWeights(Protocol):
    """Dense tensors by name, float32 (or a kernel's matrix object that multiplies like one)."""

    def has(self, name: str) -> bool: ...

    def __getitem__(self, name: str) -> Any: ...

    def is_loaded(self, name: str) -> bool:
        """Whether ``name`` is already loaded (dequantised or provided)."""
        ...

    def provide(self, name: str, value: Any) -> bool:
        """Serve ``value`` for ``name`` from now on instead of dequantising the tensor; False
        (and nothing changes) when ``name`` was already loaded."""
        ...


@dataclass
class LayerIn:
    """What one layer's dense path hands the backbone to dispatch its routed experts
    (:meth:`DenseModel.layer_in`), and takes back with their combined output
    (:meth:`DenseModel.layer_out`); one row per row of the step.

    Why one value: a layer's ggml graph computes the experts' input, the router's logits and a
    shared expert together with the attention; they travel here, explicitly, instead of being
    kept by the model and found again by matching buffer addresses in later calls."""

    h: np.ndarray  # (T, E) the residual stream after attention / DeltaNet
    cur: np.ndarray  # (T, E) the experts' input rows
    ids: np.ndarray  # (T, k) the router's final choice ((T, 0): a layer without routed experts)
    weights: np.ndarray  # (T, k)
    #: what the layer computed besides, per row, for ``layer_out`` (``"shared"``: the shared
    #: expert's output from the layer's graph); absent names are computed by ``layer_out``
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def rows(self, sel: slice | np.ndarray) -> "LayerIn":
        """These rows of every field (a sequence's span of the step, or row indices)."""
        return LayerIn(self.h[sel], self.cur[sel], self.ids[sel], self.weights[sel],
                       {k: v[sel] for k, v in self.extras.items()})

    @staticmethod
    def gather(n: int, parts: list[tuple[np.ndarray, "LayerIn"]]) -> "LayerIn":
        """One value of ``n`` rows from ``parts`` = (the rows it computed, its value), which
        cover every row once (a step computed per sequence, or in rounds). Extras only where
        every part has them."""
        first = parts[0][1]
        names = set.intersection(*(set(p.extras) for _, p in parts))

        def put(get) -> np.ndarray:
            v0 = get(first)
            out = np.empty((n, *v0.shape[1:]), v0.dtype)
            for idx, p in parts:
                out[idx] = get(p)
            return out

        return LayerIn(put(lambda p: p.h), put(lambda p: p.cur), put(lambda p: p.ids), put(lambda p: p.weights),
                       {k: put(lambda p, k=k: p.extras[k]) for k in sorted(names)})


@runtime_checkable
class DenseModel(Protocol):
    """One architecture's dense path, driven layer by layer by the backbone:

    ``h = embed(tokens)``; per layer ``il``: ``lin = layer_in(il, h, segments)`` (attention or
    DeltaNet, the experts' input, the router's choice), the routed experts of ``lin.cur`` are
    computed by owners and combined into ``moe``, ``h = layer_out(il, lin, moe)``; then
    ``output(h)`` gives the logits. (An architecture's own pieces, ``pre_moe``, ``ffn_input``,
    ``route``, ``post_moe``, are its business: tests teacher-force them against llama.cpp.)"""

    layout: Any  # p2pswarm.model.layout.ModelLayout
    #: p2pswarm.engine.backend.DenseBackend: numpy's dense path or ggml's engine, chosen once at
    #: load and given to the constructor (never attached to the weights after the fact)
    backend: Any
    n_layer: int
    n_embd: int
    n_vocab: int
    n_expert: int
    n_expert_used: int
    output_name: str

    def __init__(self, layout: Any, backend: Any) -> None:
        """Read and check ``layout``'s keys and tensors; ``backend``: as :attr:`backend` says."""
        ...

    @property
    def w(self) -> DenseWeights:
        """The dense tensors by name (read-only here: an architecture may hold a subclass)."""
        ...

    def new_state(self) -> Any:
        """A fresh per-sequence state (KV cache, recurrent state)."""
        ...

    def embed(self, tokens: np.ndarray) -> np.ndarray: ...

    def layer_in(self, il: int, h: np.ndarray, segments: list[tuple[Any, int, int]]) -> LayerIn:
        """Layer ``il`` up to its routed experts for the rows of several sequences stacked in ``h``
        (``(state, pos0, n)`` each, in order; each sequence's attention / DeltaNet on its own
        state): residual added, the experts' input, and the router's ``(ids, weights)``, each
        (n, n_expert_used), or (n, 0) for a layer without routed experts (a leading dense-FFN
        layer, whose FFN ``layer_out`` adds): the backbone then sends no request for it
        (:func:`p2pswarm.engine.routing.no_experts`)."""
        ...

    def layer_out(self, il: int, lin: LayerIn, moe: np.ndarray) -> np.ndarray:
        """The layer's output from ``lin`` and the combined routed-expert output ``moe`` (shared
        expert or dense FFN added)."""
        ...

    def layer_in_after(self, il: int, front: Any, segments: list[tuple[Any, int, int]]) -> LayerIn | None:
        """``layer_in(il, layer_out(il - 1, lin, moe), segments)`` where layer ``il - 1``'s routed
        experts are all on the backbone's ggml bank (``front``: an
        :class:`~p2pswarm.engine.experts.ggml_bank.ExpertsInFront` of them) computed with it as
        ONE graph, the same bits; None where the model does not (the backbone makes the calls)."""
        ...

    def recurrent_layer(self, il: int) -> bool:
        """Whether layer ``il`` keeps a recurrent state (qwen35moe's DeltaNet layers) rather than a
        KV cache: one of what decides its kernels (the backbone's dense-invariance probe)."""
        ...

    def chunk_verify(self, il: int) -> bool:
        """Whether :meth:`layer_in` takes a speculative verification's positions in one call
        (consecutive one-row segments of one state, each computed as its decode step would be and
        checkpointed after it); else the backbone verifies them in rounds of one position."""
        ...

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits (n, n_vocab) from the last hidden rows."""
        ...

    def output_after(self, front: Any) -> np.ndarray | None:
        """``output(layer_out(L - 1, lin, moe))`` as ONE graph with the last layer's routed experts
        (``front``, as :meth:`layer_in_after`'s) where its ``layer_out`` is ``h + moe``; None where not."""
        ...

    def decode_graph(self, token: int, state: Any, bank: Any, plan: Callable) -> np.ndarray | None:
        """A one-sequence decode step (``token`` fed after what ``state`` has seen; the caller
        advances ``state.n_past``) as ONE graph, every layer's routed experts on the backbone's ggml
        ``bank``: its logits (1, n_vocab), the bits of the per-layer calls; None where the model
        does not (the backbone makes the calls). ``plan(il, ids, weights)``: the backbone's
        grouping of layer ``il``'s routing into :func:`~p2pswarm.engine.experts.ggml_bank.slot_pairs`
        (or None), called from inside the graph."""
        ...



#: ``routed(cur, ids, weights)``: the routed experts' output for the rows ``cur``, combined in the
#: router's top-k order (wherever the caller has them computed)
Routed = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class MtpEnds:
    """What an architecture's MTP (NextN) block reads around its layer: the tensors of the
    embedding, the output head and the head's norm (``blk.N.nextn.shared_head_norm``, or
    ``output_norm`` where the architecture lets a file leave it out), and every tensor its layer and
    ends read, ``(name, shape)`` in the order they are checked (shape None: any)."""

    embed: str
    head: str
    head_norm: str
    need: list[tuple[str, tuple[int, ...] | None]]


@runtime_checkable
class MtpModel(Protocol):
    """A dense path that runs its file's MTP (NextN) block, llama.cpp's ``graph_mtp``, as the
    speculative drafter (:mod:`p2pswarm.backbone.mtp`: the fusion ``eh_proj(enorm(embed),
    hnorm(h))`` before the layer and the head after it are every architecture's; the layer between
    them is the architecture's own). Implementing it is the capability: the registry
    (:func:`p2pswarm.engine.arch.mtp_architectures`) reads it off the class, no list of names."""

    def mtp_blocks(self) -> int:
        """How many MTP (NextN) blocks the file has after the trunk (0: none to run)."""
        ...

    def mtp_ends(self, il: int) -> MtpEnds:
        """The block at layer ``il``: its ends and the tensors it reads (checked when it is built)."""
        ...

    def mtp_cache(self) -> Any:
        """A fresh attention cache for the block (``checkpoint``/``restore``: a draft's entries are dropped)."""
        ...

    def mtp_layer(self, il: int, cache: Any, x: np.ndarray, pos0: int, routed: Routed, *,
                  last_only: bool = False) -> np.ndarray:
        """The block's layer on the fused rows ``x`` (positions ``pos0..``, appended to ``cache``),
        its routed experts through ``routed``: the rows before the head norm. ``last_only``: the
        attention still runs on every row (the cache takes them all), but only the last row goes on
        through the MoE (returned as one row): a draft reads the last row's logits only, as
        llama.cpp's graphs carry on only the rows that reach an output (``inp_out_ids``)."""
        ...


@dataclass
class OwnerStatus:
    """What the status page shows of one owner (:meth:`Owner.status`); None: the owner does not
    know it (an in-process worker has no round trip, a socket worker no peer id)."""

    peer: str | None = None
    addrs: list[str] = field(default_factory=list)
    rtt_s: float | None = None
    refused: str | None = None  # why the worker's handshake refused us
    relayed: bool = False  # requests go through a circuit relay
    lane: str | None = None  # "libp2p" or "direct" once connected
    load: int | None = None  # requests in flight
    requests: int | None = None
    failures: int | None = None
    wire: dict | None = None  # bytes sent / received (p2pswarm.net.wire.counting)
    kernel: str | None = None


@runtime_checkable
class Owner(Protocol):
    """Something that computes the experts of some (layer, expert) ranges for the dispatcher.

    ``remote`` False means "this process, always there" (the fallback replica); a remote owner
    may fail, and then raises :class:`p2pswarm.errors.WorkerError` so the dispatcher falls back.
    Subclass it to get the defaults: every member below the two methods has one, so the
    dispatcher and the status page read them directly, never probing with ``getattr``.

    Why these members: the dispatcher's hot path needs ``peer`` (whom work is credited to and
    banned by), ``rtt_s`` and :meth:`predict_s` (the hot-expert path's estimate of a round trip)
    and ``recovered_at`` (a late reply ends a back-off); it hands an owner the backbone's
    ``wire_precision`` and, when the owner takes quantised input rows of our ``kernel``, our bank as
    its ``input_quantiser``, and adds its ``wire`` bytes to the backbone's total."""

    name: str = "owner"
    remote: bool = True
    #: EWMA of answered requests' round trips, compute included; None: not measured (never kept local)
    rtt_s: float | None = None
    #: time.monotonic() of the last late reply read after a missed deadline (ends its back-off)
    recovered_at: float | None = None
    #: half-open ``(begin, end)`` layer and expert ranges it holds; None: ask :meth:`holds`
    layers: tuple[int, int] | None = None
    experts: tuple[int, int] | None = None
    #: why its handshake refused us (it then holds nothing); None: not refused
    refused: str | None = None
    kernel: str | None = None  # the kernel id it computes with, where known
    wire: Any = None  # its p2pswarm.net.wire.counting.WireBytes, for a remote owner that counts bytes
    wire_precision: str | None = None  # the backbone's --wire-precision (set by the dispatcher)
    #: the bank that turns our rows into a form the owner's kernel takes (set by the dispatcher
    #: when that bank computes in the owner's ``kernel``); None: rows go as float32
    input_quantiser: Any = None

    @property
    def peer(self) -> str | None:
        """The libp2p peer id its work is credited to and banned by; None: no network identity
        (its ``name`` stands in: :func:`p2pswarm.backbone.dispatch.dispatcher.peer_of`)."""
        return None

    def holds(self, layer: int, expert: int) -> bool:
        """Whether this owner computes expert ``expert`` of layer ``layer``."""
        ...

    async def compute(self, layer: int, cur: np.ndarray, groups: Groups) -> list[np.ndarray]:
        """Outputs per group, in order; raise WorkerError on any failure."""
        ...

    def predict_s(self, rows: int) -> float | None:
        """Its expected round trip for a request of ``rows`` (expert, row) pairs, where it fits one
        to its recent requests; None: use ``rtt_s``."""
        return None

    def status(self) -> OwnerStatus:
        """What the status page shows of it."""
        return OwnerStatus(peer=self.peer, rtt_s=self.rtt_s, refused=self.refused, kernel=self.kernel,
                           wire=self.wire.as_dict() if self.wire is not None else None)

    async def aclose(self) -> None:
        """Release connections and processes (default: nothing to release)."""
        return None


__all__ = ["DenseModel", "DenseWeights", "ExpertBank", "Groups", "Owner", "OwnerStatus"]
