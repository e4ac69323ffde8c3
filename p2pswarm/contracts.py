"""The interfaces the parts of p2pswarm meet at, as :class:`typing.Protocol` s.

Why in code: they used to live in prose ("the same interface as ExpertBank"). A new kernel, a new
architecture or a new transport implements one of these; nothing else has to know which one it
got. The protocols are ``runtime_checkable`` so a test (``tests/test_contracts.py``) can check
that every implementation has every member; mypy (default mode, ``tests/test_typecheck.py``)
checks the packages that use them.

- :class:`ExpertBank`: computes routed experts (numpy, ggml and portable kernels; a worker and the
  backbone's fallback replica hold one). Made by :func:`p2pswarm.engine.kernels.make_bank`.
- :class:`DenseModel`: one architecture's dense path (attention/DeltaNet, norms, router, lm head);
  the backbone's layer loop (:class:`p2pswarm.backbone.runner.Backbone`) drives it. Made by
  :func:`p2pswarm.engine.arch.load_dense`.
- :class:`DenseWeights`: the dense tensors a model reads by name, which the ggml backend replaces
  by its own quantised matrices (:meth:`p2pswarm.engine.backend.DenseBackend.take`, at load).
- :class:`Owner`: something the dispatcher sends rows to (the local replica, an in-process
  worker, a TCP or libp2p worker), with what the dispatcher and the status page read of it
  (:class:`OwnerStatus`). Implementations subclass it for the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

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


@runtime_checkable
class DenseModel(Protocol):
    """One architecture's dense path, driven layer by layer by the backbone:

    ``h = embed(tokens)``; per layer ``il``: ``h = pre_moe(il, h, state, pos0)``,
    ``cur = ffn_input(il, h)``, ``ids, w = route(il, cur)``, the routed experts of ``cur`` are
    computed by owners and combined into ``moe``, ``h = post_moe(il, h, cur, moe)``; then
    ``output(h)`` gives the logits."""

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

    @property
    def w(self) -> DenseWeights:
        """The dense tensors by name (read-only here: an architecture may hold a subclass)."""
        ...

    def new_state(self) -> Any:
        """A fresh per-sequence state (KV cache, recurrent state)."""
        ...

    def embed(self, tokens: np.ndarray) -> np.ndarray: ...

    def pre_moe(self, il: int, h: np.ndarray, state: Any, pos0: int) -> np.ndarray:
        """Layer ``il`` up to the MoE block (attention or DeltaNet, residual added)."""
        ...

    def pre_moe_batch(self, il: int, h: np.ndarray, segments: list[tuple[Any, int, int]]) -> np.ndarray:
        """:meth:`pre_moe` of several sequences' rows stacked in ``h``: ``(state, pos0, n)`` each."""
        ...

    def ffn_input(self, il: int, h: np.ndarray) -> np.ndarray:
        """The normed rows the router and the experts see."""
        ...

    def route(self, il: int, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(expert ids, weights)``, each (n, n_expert_used): the router's final choice; each
        (n, 0) for a layer without routed experts (a leading dense-FFN layer, whose FFN
        ``post_moe`` adds): the backbone then sends no request for it
        (:func:`p2pswarm.engine.routing.no_experts`)."""
        ...

    def post_moe(self, il: int, h: np.ndarray, cur: np.ndarray, moe: np.ndarray) -> np.ndarray:
        """The layer's output from the combined routed-expert output ``moe`` (shared expert added)."""
        ...

    def output(self, h: np.ndarray) -> np.ndarray:
        """Logits (n, n_vocab) from the last hidden rows."""
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
    wire: dict | None = None  # bytes sent / received (p2pswarm.net.wire_bytes)
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
    wire: Any = None  # its p2pswarm.net.wire_bytes.WireBytes, for a remote owner that counts bytes
    wire_precision: str | None = None  # the backbone's --wire-precision (set by the dispatcher)
    #: the bank that turns our rows into a form the owner's kernel takes (set by the dispatcher
    #: when that bank computes in the owner's ``kernel``); None: rows go as float32
    input_quantiser: Any = None

    @property
    def peer(self) -> str | None:
        """The libp2p peer id its work is credited to and banned by; None: no network identity
        (its ``name`` stands in: :func:`p2pswarm.backbone.dispatch.peer_of`)."""
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
