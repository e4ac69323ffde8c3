"""The worker: a pure function (hidden rows, expert ids) -> output rows, built from a shard alone.

It opens only its expert shard (a mini-GGUF the slicer cut): no attention, no router, no other
experts, no KV cache, no sampler. Every request is checked against what the shard holds, and the
computation is the bank's ``forward_groups``, the very code the monolithic run uses, with the kernel
chosen by :func:`p2pswarm.engine.kernels.make_bank` (whose name the handshake compares).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from functools import partial

import numpy as np

from p2pswarm import settings
from p2pswarm.engine.kernels import answer_families, family, kernel_id, make_bank, portable_family
from p2pswarm.engine.experts.portable_kernel import PortableExpertBank
from p2pswarm.engine.experts.portable_kernel import refusal as portable_refusal
from p2pswarm.errors import UserError
from p2pswarm.model.layout import ModelLayout, shard_hash
from p2pswarm.model.manifest import source_fingerprint
from p2pswarm.offload import Offload


@dataclass(frozen=True)
class ShardInfo:
    model_fingerprint: str
    layer_begin: int
    layer_end: int
    expert_begin: int
    expert_end: int
    n_embd: int
    kernel: str

    def describe(self) -> str:
        return (f"layers {self.layer_begin}-{self.layer_end - 1}, experts {self.expert_begin}-{self.expert_end - 1}"
                f" of model {self.model_fingerprint[:12]}")


def shard_info(layout: ModelLayout, kernel: str) -> ShardInfo:
    if layout.shard_kind != "experts":
        raise UserError(f"{layout.path}: not an expert shard (cut one with `p2pswarm slice`)")
    layers = layout.expert_layers
    return ShardInfo(
        model_fingerprint=source_fingerprint(layout),
        layer_begin=layers[0],
        layer_end=layers[-1] + 1,
        expert_begin=layout.expert_begin,
        expert_end=layout.expert_end,
        n_embd=int(layout.hparam("embedding_length", required=True)),
        kernel=kernel,
    )


class ExpertWorker:
    def __init__(self, shard_path: str | os.PathLike[str], *, kernel: str | None = None, **bank_options):
        """``kernel``: "auto" | "numpy" | "ggml" | "portable" (None: $P2PSWARM_KERNEL, else auto);
        ``bank_options`` go to :func:`make_bank` (``cache_bytes`` for numpy, ``threads`` for ggml
        and portable, ``graph_cache_bytes`` for ggml: default ``$P2PSWARM_WORKER_GRAPH_CACHE_MB``).

        Why a worker keeps graphs too: a decode step sends it requests of a few rows whose shapes
        recur every step, and building the request's ggml graph through ctypes cost about as much
        as the math itself (tiny q8_0 model, 1 row, 1-2 experts: 57-72 us a call built, 28-38 us
        kept). A small cache (16 MiB: a 122B-geometry request of 64 rows is ~2.4 MiB) holds the
        recurring shapes; a kept graph computes the same bits as a fresh one."""
        layout = ModelLayout.open(shard_path)
        bank_options.setdefault("graph_cache_bytes", settings.WORKER_GRAPH_CACHE_MB.get() << 20)
        self.bank = make_bank(layout, kernel, **bank_options)
        self.info = shard_info(layout, self.bank.kernel)
        #: the kernel families this worker answers in (its own, then portable): the hello says them
        self.families = answer_families(self.bank.kernel)
        if portable_refusal(layout) is not None:  # gpt-oss: the portable kernel cannot answer
            self.families = (family(self.bank.kernel),)
        self._layout = layout
        self._threads = bank_options.get("threads")
        self._portable: PortableExpertBank | None = None  # the portable bank, built on the first request that asks for it
        self._portable_lock = threading.Lock()
        #: where each request's math runs: inline on the event loop when measured short, else in
        #: a thread (p2pswarm.offload; one per worker: its bank's lock is the one to not wait on)
        self.offload = Offload()

    async def compute_async(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]],
                            family: str | None = None, form: str | None = None) -> list[np.ndarray]:
        """:meth:`compute` from the event loop: inline when its expected time (seconds per routed
        row, measured per kernel family) is below the offload bound, else in a thread, so a big
        request never holds up the other connections. The same bits either way."""
        n = sum(len(idx) for _, idx in groups)
        return await self.offload.run(partial(self.compute, layer, rows, groups, family, *([form] if form else [])), n, ("compute", family))

    def bank_for(self, family_name: str | None = None):
        """The bank that answers in ``family_name`` (None: this worker's own kernel); a UserError
        for a family this worker cannot answer in. The portable bank reads the same mapped shard
        (no copy), so answering portably on request costs no memory."""
        if family_name is None or family_name == family(self.info.kernel):
            return self.bank
        if family_name != portable_family():
            raise UserError(f"cannot answer in kernel family {family_name!r} "
                            f"(this worker answers in {', '.join(self.families)})")
        with self._portable_lock:
            if self._portable is None:
                self._portable = PortableExpertBank(self._layout, threads=self._threads)
            return self._portable

    @staticmethod
    def describe_shard(shard_path: str | os.PathLike[str], kernel: str | None = None) -> ShardInfo:
        """What a shard holds, without loading it (``kernel``: what a worker started with it would use)."""
        return shard_info(ModelLayout.open(shard_path), kernel_id(kernel))

    def input_forms(self) -> list[str]:
        """The input forms (besides float32) this worker's own kernel takes rows in
        (p2pswarm.engine.ggml.inputs: the bytes ggml would make of float32 rows anyway)."""
        forms = getattr(self.bank, "input_forms", None)
        return forms() if forms is not None else []

    def compute(self, layer: int, rows: np.ndarray, groups: list[tuple[int, np.ndarray]],
                family: str | None = None, form: str | None = None) -> list[np.ndarray]:
        """Outputs for each (expert, row indices) group, in the order given, computed in kernel
        ``family`` (one of :attr:`families`; None: this worker's own kernel). ``form``: the rows
        are already in that input form (only this worker's own kernel takes one)."""
        bank = self.bank_for(family)
        if form is not None and (bank is not self.bank or form not in self.input_forms()):
            raise UserError(f"rows in form {form}: this worker takes them in float32 only"
                            + (f" in kernel family {family}" if bank is not self.bank else ""))
        if form is None and (rows.ndim != 2 or rows.shape[1] != self.info.n_embd):
            raise UserError(f"rows have shape {rows.shape}, expected (n, {self.info.n_embd})")
        for e, _ in groups:
            if not self.bank.holds(layer, e):
                raise UserError(f"expert {e} of layer {layer} is not in this shard ({self.info.describe()})")
        # (the bank checks a form's row width and that it is this layer's form)
        return bank.forward_groups(layer, rows, groups) if form is None else bank.forward_groups(layer, rows, groups, form)


def worker_shard_hash(worker: ExpertWorker) -> str:
    """The shard hash (:func:`p2pswarm.model.layout.shard_hash`) of a worker's shard file, which its
    node record and hello name; "" for a bank with no shard file behind it."""
    layout = getattr(worker.bank, "layout", None)
    if layout is None or not hasattr(layout, "reader"):
        return ""
    return shard_hash(layout)
