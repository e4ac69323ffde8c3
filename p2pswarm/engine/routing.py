"""The router's choice for every MoE architecture we serve, as llama.cpp's ``build_moe_ffn`` makes it.

The router runs on the backbone and decides, once, which experts each row goes to and with what
weight; workers only compute the experts they are sent. So this one function fixes the model's
numerics for every arch: it must pick what llama.cpp picks. Step by step (``logits`` = the router
mat-mul's output, (n, n_expert) float32)::

    probs  = softmax(logits)        (gating "softmax": qwen3moe, qwen35moe, DeepSeek-V2)
           | sigmoid(logits)        (gating "sigmoid": DeepSeek-V3/R1, Kimi K2, GLM-4.5)
    select = probs + exp_probs_b    (the score-correction bias, if the layer has one: for the
                                     choice ONLY; the weights come from the unbiased probs)
    if n_group > 1:                 (group-limited top-k, DeepSeek's "noaux_tc")
        experts split into n_group consecutive groups; a group's score is the sum of its two
        highest ``select`` values; the n_group_used best groups are kept, the other groups'
        experts get -inf
    ids     = top n_expert_used of select, best first
    weights = probs[ids]
    if norm_weights: weights /= max(sum(weights), 2^-14)    (llama.cpp's clamp: F16's smallest;
                                                             the sum in float64, as ggml's sum_rows)
    if scale not in (0, 1): weights *= scale

Ties: llama.cpp's CPU argsort is ``std::sort``, which leaves the order of equal values unspecified;
here equal scores keep the lower expert (or group) id first, always (a stable sort), so every node
of the swarm picks the same. The group score's two-value sum is taken in float64 and rounded
once, as ggml's ``sum_rows`` does.

With softmax gating, no bias, no groups, normalised weights and scale 1 this is exactly
:func:`p2pswarm.engine.ops.route_topk` (the qwen3moe/qwen35moe router), bit for bit (tested).

:meth:`RouterSpec.from_layout` reads the GGUF keys and refuses, at load, a combination llama.cpp
would abort on or that cannot route (one line naming the key), never a numpy error mid-request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2pswarm.engine import ops
from p2pswarm.errors import ModelFormatError

F32 = np.float32

#: ``{arch}.expert_gating_func`` values (llama.cpp's ``llama_expert_gating_func_type``) we compute
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
#: the renormalising sum's lower clamp (llama.cpp: the smallest normal F16)
NORM_MIN = F32(6.103515625e-5)


@dataclass(frozen=True)
class RouterSpec:
    """How a model's router turns logits into (expert ids, weights); see the module doc.

    ``n_group`` 1 means no group limit. ``scale`` 1.0 means none (a GGUF's 0 also means none)."""

    n_expert: int
    n_expert_used: int
    gating: str  # "softmax" | "sigmoid"
    n_group: int = 1
    n_group_used: int = 1
    norm_weights: bool = False
    scale: float = 1.0

    @classmethod
    def from_layout(cls, layout, *, default_gating: str = "softmax", norm_weights: bool | None = None) -> "RouterSpec":
        """The spec a GGUF's keys give: ``{arch}.expert_count``, ``expert_used_count``,
        ``expert_gating_func`` (1 softmax, 2 sigmoid; absent or 0: ``default_gating``, what
        llama.cpp's loader assumes for the architecture, which passes it: its ``DEFAULT_GATING``),
        ``expert_group_count``, ``expert_group_used_count``, ``expert_weights_norm`` (absent:
        False, llama.cpp's default), ``expert_weights_scale`` (absent or 0: none).

        ``norm_weights``: an architecture whose llama.cpp graph fixes it whatever the file says
        (qwen3moe and qwen35moe always normalise) passes it here. Raises a one-line
        :class:`ModelFormatError` naming the key for a combination that cannot route."""
        arch = layout.arch

        def bad(key: str, why: str) -> ModelFormatError:
            return ModelFormatError(f"{layout.path}: key {arch}.{key} {why}")

        def as_int(key: str, default: int | None) -> int:
            v = layout.hparam(key, default, required=default is None)
            if isinstance(v, list):  # per-layer arrays: fine when every entry agrees
                if not v or len(set(v)) != 1:
                    raise bad(key, f"differs between layers ({v!r}): unsupported")
                v = v[0]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise bad(key, f"must be an integer, got {v!r}")
            return int(v)

        n_expert = as_int("expert_count", None)
        n_used = as_int("expert_used_count", None)
        func = as_int("expert_gating_func", 0)
        if func == 0:
            gating = default_gating
        elif func in GATING_FUNCS:
            gating = GATING_FUNCS[func]
        else:
            raise bad("expert_gating_func", f"is {func}: only 1 (softmax) and 2 (sigmoid) are supported")
        n_group = as_int("expert_group_count", 0)
        n_group_used = as_int("expert_group_used_count", 0)
        norm = layout.hparam("expert_weights_norm", False)
        if not isinstance(norm, (bool, np.bool_, int, np.integer)):
            raise bad("expert_weights_norm", f"must be a boolean, got {norm!r}")
        scale = layout.hparam("expert_weights_scale", 0.0)
        if isinstance(scale, (bool, list, str)) or not math.isfinite(float(scale)):
            raise bad("expert_weights_scale", f"must be a finite number, got {scale!r}")

        if n_expert <= 0:
            raise bad("expert_count", f"must be positive, got {n_expert}")
        if not 0 < n_used <= n_expert:
            raise bad("expert_used_count", f"is {n_used}: must be 1..expert_count ({n_expert})")
        if n_group > 1:
            # llama.cpp's loader asserts these (it would abort); a group's score needs two experts
            if n_expert % n_group:
                raise bad("expert_group_count", f"{n_group} does not divide expert_count {n_expert}")
            if n_expert // n_group < 2:
                raise bad("expert_group_count", f"{n_group} leaves fewer than 2 experts per group "
                                                f"(expert_count {n_expert})")
            if not 0 < n_group_used < n_group:
                raise bad("expert_group_used_count", f"is {n_group_used}: must be 1..expert_group_count - 1 "
                                                     f"({n_group - 1})")
            if n_group_used * (n_expert // n_group) < n_used:
                raise bad("expert_group_used_count", f"{n_group_used} groups of {n_expert // n_group} experts "
                                                     f"hold fewer than expert_used_count {n_used}")
        else:
            n_group, n_group_used = 1, 1
        return cls(n_expert=n_expert, n_expert_used=n_used, gating=gating, n_group=n_group,
                   n_group_used=n_group_used, norm_weights=bool(norm) if norm_weights is None else norm_weights,
                   scale=float(scale) if float(scale) != 0.0 else 1.0)


def route(logits: np.ndarray, spec: RouterSpec, bias: np.ndarray | None = None, *,
          probs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64 (n, k), weights float32 (n, k))`` for router ``logits`` (n, n_expert), best
    first; ``bias`` is the layer's ``exp_probs_b`` (n_expert,) or None. See the module doc.
    ``probs``: the gating function of ``logits`` already computed (by ggml's own sigmoid / softmax,
    whose last bits numpy's ``exp`` does not always give), used instead of computing it here."""
    logits = logits.astype(F32, copy=False)
    n, k = logits.shape[0], spec.n_expert_used
    if probs is not None:
        probs = probs.astype(F32, copy=False)
    elif spec.gating == "softmax":
        probs = ops.softmax(logits, axis=-1)
    elif spec.gating == "sigmoid":
        with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: sigmoid 0, as in C
            probs = ops.sigmoid(logits)
    else:
        raise ValueError(f"unknown gating {spec.gating!r}")
    select = probs if bias is None else probs + np.asarray(bias, dtype=F32).reshape(1, -1)
    if spec.n_group > 1 and n:
        per = spec.n_expert // spec.n_group
        grouped = select.reshape(n, spec.n_group, per)
        top2 = -np.sort(-grouped, axis=-1)[..., :2]
        score = (top2[..., 0].astype(np.float64) + top2[..., 1]).astype(F32)  # (n, n_group)
        keep = np.argsort(-score, axis=-1, kind="stable")[:, : spec.n_group_used]
        dropped = np.ones((n, spec.n_group), dtype=bool)
        np.put_along_axis(dropped, keep, False, axis=-1)
        select = np.where(dropped[:, :, None], F32(-np.inf), grouped).reshape(n, spec.n_expert)
    order = np.argsort(-select, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, order, axis=-1)
    if spec.norm_weights:
        # the sum in float64, rounded once, as ggml's sum_rows (ggml_vec_sum_f32) takes it: a float32
        # sum of the k weights is 1 ulp off in ~1 row of 4, and then so is every routed output
        total = np.sum(weights, axis=-1, keepdims=True, dtype=np.float64).astype(F32)
        weights = weights / np.maximum(total, NORM_MIN)
    if spec.scale not in (0.0, 1.0):
        weights = weights * F32(spec.scale)
    return order.astype(np.int64), weights.astype(F32, copy=False)


def no_experts(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The route of a layer without routed experts (a leading dense-FFN layer): ids and weights of
    shape (n, 0). The backbone then sends no request for the layer; ``post_moe`` adds the FFN."""
    return np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0), dtype=F32)
