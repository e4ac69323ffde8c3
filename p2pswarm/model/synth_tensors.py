"""What a synthetic model's tensors are and their bytes: the plan of both architectures (name,
shape, type, scale of every tensor), random but valid Q4_K blocks, and the seeded chunked generator.

Split from ``synth.py``; the weight-scaling rule is in that module's docstring.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Iterator, Sequence

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, ROUTER_NEAR_TIE_SCALE, Preset, Qwen35Preset, _gguf

# Q4_K: 256 weights in a super-block of 144 bytes (f16 d, f16 dmin, 12 bytes of 6-bit
# scales/mins for 8 sub-blocks of 32, 128 bytes of 4-bit quants).
QK_K = 256
Q4_K_BLOCK_BYTES = 144
# Sub-block scales drawn uniformly from this range (6-bit); mins equal the scales, dmin = 7.5 d,
# so a weight is d * sc * (q - 7.5): zero mean, std d * rms(sc) * std(q).
_Q4K_SC_LO, _Q4K_SC_HI = 32, 63
_Q4K_Q_STD = float(np.sqrt((16 * 16 - 1) / 12.0))  # std of a uniform 4-bit quant (4.61)
_Q4K_SC_RMS = float(np.sqrt(np.mean(np.arange(_Q4K_SC_LO, _Q4K_SC_HI + 1, dtype=np.float64) ** 2)))


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(name.encode())]))


def _normal(rng: np.random.Generator, shape: Sequence[int], std: float) -> np.ndarray:
    a = rng.standard_normal(size=tuple(shape), dtype=np.float32)
    a *= np.float32(std)
    return a



# ---------------------------------------------------------------------------------------------
# Random Q4_K


def q4_k_d_for_std(std: float) -> float:
    """The super-block scale ``d`` that gives dequantised weights of standard deviation ``std``."""
    return std / (_Q4K_SC_RMS * _Q4K_Q_STD)


def _pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> (n, 12) bytes, the layout of ggml's get_scale_min_k4."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def random_q4_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random valid Q4_K super-blocks, uint8 of shape (n_blocks, 144).

    Quants uniform in 0..15; 6-bit sub-block scales uniform in 32..63 with mins equal to the
    scales; ``dmin = 7.5 d``, so a weight is ``d * sc * (q - 7.5)``: mean ~0, standard deviation
    ``std`` (``d`` = :func:`q4_k_d_for_std` with +-10% jitter per super-block).
    """
    d = (q4_k_d_for_std(std) * rng.uniform(0.9, 1.1, size=n_blocks)).astype(np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    sc = rng.integers(_Q4K_SC_LO, _Q4K_SC_HI + 1, size=(n_blocks, 8), dtype=np.uint8)
    out = np.empty((n_blocks, Q4_K_BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(n_blocks, 2)
    out[:, 4:16] = _pack_q4_k_scales(sc, sc)
    out[:, 16:] = np.frombuffer(rng.bytes(n_blocks * 128), dtype=np.uint8).reshape(n_blocks, 128)
    return out


# ---------------------------------------------------------------------------------------------
# The tensor plan


@dataclasses.dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first
    kind: str  # "norm", "matrix", "experts", "router", "embd"
    std: float
    gtype: Any  # gguf.GGMLQuantizationType
    nbytes: int
    # A fused tensor (ffn_gate_up_exps): the plans whose bytes it concatenates, expert by expert.
    parts: tuple["TensorPlan", ...] = ()


def plan_adder(plans: list, dense: Any, exp_t: Any):
    """``add(name, shape, kind, std, parts=())``, which appends a :class:`TensorPlan` to ``plans`` typed
    by its kind: F32 for norms, routers and vectors, ``exp_t`` for the routed experts, ``dense`` for
    the rest (what every architecture's plan does)."""
    F32 = _gguf().GGMLQuantizationType.F32

    def add(name: str, shape: tuple[int, ...], kind: str, std: float, parts=()) -> None:
        t = F32 if kind in ("norm", "router", "vector") else exp_t if kind == "experts" else dense
        plans.append(TensorPlan(name, shape, kind, std, t, _type_size(t, shape), parts))

    return add


def _type_size(gtype: Any, shape: Sequence[int]) -> int:
    g = _gguf()
    block, size = g.GGML_QUANT_SIZES[gtype]
    n = int(np.prod(shape))
    if shape[-1] % block:
        raise UserError(f"row length {shape[-1]} is not a multiple of {block} ({gtype.name})")
    return n // block * size


def _plan(dims: Preset, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
          router_near_tie: bool) -> list[TensorPlan]:
    g = _gguf()
    Q = g.GGMLQuantizationType
    dense = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k_m": Q.F32}[qtype]
    if expert_qtype == "q4_k":
        exp_t = Q.Q4_K
    else:
        exp_t = dense
    E, D, F, V = dims.n_embd, dims.n_expert, dims.n_ff_exp, n_vocab
    H, Hkv, hd = dims.n_head, dims.n_head_kv, dims.head_dim
    plans: list[TensorPlan] = []

    add = plan_adder(plans, dense, exp_t)

    add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
    router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
    for i in range(dims.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
        add(p + "attn_q.weight", (H * hd, E), "matrix", 1 / np.sqrt(E))
        add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
        add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
        add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
        add(p + "attn_q_norm.weight", (hd,), "norm", NORM_NOISE)
        add(p + "attn_k_norm.weight", (hd,), "norm", NORM_NOISE)
        add(p + "ffn_norm.weight", (E,), "norm", NORM_NOISE)
        add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
        add(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
        add(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
        add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
    add("output_norm.weight", (E,), "norm", NORM_NOISE)
    if not tied:
        add("output.weight", (V, E), "matrix", LOGIT_STD / np.sqrt(E))
    return plans


def _plan_qwen35(dims: Qwen35Preset, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
                 router_near_tie: bool) -> list[TensorPlan]:
    """The tensors of a qwen35moe model, in file order (llama.cpp's names and shapes)."""
    g = _gguf()
    Q = g.GGMLQuantizationType
    dense = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k_m": Q.F32}[qtype]
    exp_t = Q.Q4_K if expert_qtype == "q4_k" else dense
    E, D, F, V = dims.n_embd, dims.n_expert, dims.n_ff_exp, n_vocab
    H, Hkv, hd = dims.n_head, dims.n_head_kv, dims.head_dim
    d, Hk, Hv, K = dims.ssm_state_size, dims.ssm_group_count, dims.ssm_time_step_rank, dims.ssm_conv_kernel
    C = 2 * Hk * d + Hv * d
    plans: list[TensorPlan] = []

    def plan(name: str, shape: tuple[int, ...], kind: str, std: float) -> TensorPlan:
        if kind in ("norm", "router", "vector", "conv", "ssm_a"):
            t = Q.F32  # llama.cpp keeps these F32 (its quantiser too)
        elif kind == "experts":
            t = exp_t
        else:
            t = dense
        return TensorPlan(name, shape, kind, std, t, _type_size(t, shape))

    def add(name: str, shape: tuple[int, ...], kind: str, std: float) -> None:
        plans.append(plan(name, shape, kind, std))

    add("token_embd.weight", (V, E), "embd", LOGIT_STD / np.sqrt(E) if tied else 1.0)
    router_std = (ROUTER_NEAR_TIE_SCALE if router_near_tie else 1.0) / np.sqrt(E)
    for i in range(dims.n_layer + dims.n_nextn):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
        # an MTP block (i >= n_layer) is gated full attention whatever the interval says: llama.cpp's
        # loader marks only trunk layers recurrent (``is_recr_impl[i] = i < n_layer() && ...``)
        if i < dims.n_layer and (i + 1) % dims.full_attention_interval != 0:  # Gated DeltaNet
            add(p + "attn_qkv.weight", (C, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_gate.weight", (Hv * d, E), "matrix", 1 / np.sqrt(E))
            add(p + "ssm_conv1d.weight", (C, K), "conv", 1 / np.sqrt(K))
            add(p + "ssm_dt.bias", (Hv,), "vector", 0.5)
            add(p + "ssm_a", (Hv,), "ssm_a", 0.0)
            add(p + "ssm_beta.weight", (Hv, E), "matrix", 1 / np.sqrt(E))
            add(p + "ssm_alpha.weight", (Hv, E), "matrix", 1 / np.sqrt(E))
            add(p + "ssm_norm.weight", (d,), "norm", NORM_NOISE)
            add(p + "ssm_out.weight", (E, Hv * d), "matrix", 1 / np.sqrt(Hv * d))
        else:  # gated full attention: attn_q holds q and its gate, interleaved head by head
            add(p + "attn_q.weight", (2 * H * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_k.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_v.weight", (Hkv * hd, E), "matrix", 1 / np.sqrt(E))
            add(p + "attn_output.weight", (E, H * hd), "matrix", 1 / np.sqrt(H * hd))
            add(p + "attn_q_norm.weight", (hd,), "norm", NORM_NOISE)
            add(p + "attn_k_norm.weight", (hd,), "norm", NORM_NOISE)
        add(p + "post_attention_norm.weight", (E,), "norm", NORM_NOISE)
        add(p + "ffn_gate_inp.weight", (D, E), "router", router_std)
        gate = plan(p + "ffn_gate_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
        up = plan(p + "ffn_up_exps.weight", (D, F, E), "experts", 1 / np.sqrt(E))
        if dims.fused_experts:
            plans.append(TensorPlan(p + "ffn_gate_up_exps.weight", (D, 2 * F, E), "experts", gate.std,
                                    gate.gtype, gate.nbytes + up.nbytes, parts=(gate, up)))
        else:
            plans += [gate, up]
        add(p + "ffn_down_exps.weight", (D, E, F), "experts", 1 / np.sqrt(F))
        Fs = dims.n_ff_shexp
        add(p + "ffn_gate_inp_shexp.weight", (E,), "vector", 1 / np.sqrt(E))
        add(p + "ffn_gate_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
        add(p + "ffn_up_shexp.weight", (Fs, E), "matrix", 1 / np.sqrt(E))
        add(p + "ffn_down_shexp.weight", (E, Fs), "matrix", 1 / np.sqrt(Fs))
        if i >= dims.n_layer:  # the NextN / MTP block: what llama.cpp's qwen35moe MTP graph reads besides it
            add(p + "nextn.eh_proj.weight", (E, 2 * E), "matrix", 1 / np.sqrt(2 * E))
            add(p + "nextn.enorm.weight", (E,), "norm", NORM_NOISE)
            add(p + "nextn.hnorm.weight", (E,), "norm", NORM_NOISE)
            add(p + "nextn.shared_head_norm.weight", (E,), "norm", NORM_NOISE)
    add("output_norm.weight", (E,), "norm", NORM_NOISE)
    if not tied:
        add("output.weight", (V, E), "matrix", LOGIT_STD / np.sqrt(E))
    return plans


# Elements generated per chunk (and so the most float32 values held at once): ~16 MiB.
_CHUNK_ELEMS = 1 << 22


def _tensor_chunks(plan: TensorPlan, seed: int) -> Iterator[bytes | np.ndarray]:
    """The tensor's bytes, in order, a bounded chunk at a time. Chunking depends only on the shape."""
    g = _gguf()
    Q = g.GGMLQuantizationType
    if plan.kind in ("kv_b_k", "kv_b_v"):  # deepseek2's split MLA tensors: cut from one attn_kv_b
        from p2pswarm.model.synth_deepseek2 import kv_b_part

        name, shape, kind, std = plan.parts[0]
        whole = np.concatenate([np.asarray(c) for c in _tensor_chunks(
            TensorPlan(name, shape, kind, std, Q.F32, _type_size(Q.F32, shape)), seed)])
        part = kv_b_part(plan, whole)
        yield part if plan.gtype == Q.F32 else part.astype(np.float16) if plan.gtype == Q.F16 else \
            g.quants.quantize(part, plan.gtype)
        return
    if plan.parts:
        # Fused: expert by expert, the bytes of each part (each from its own generator, chunked as
        # if written alone), so the fused tensor holds exactly the separate tensors' weights.
        streams = [_tensor_chunks(part, seed) for part in plan.parts]
        per_expert = [part.nbytes // part.shape[0] for part in plan.parts]
        for chunks in zip(*streams):
            raw = [np.ascontiguousarray(c).reshape(-1).view(np.uint8) for c in chunks]
            n = raw[0].size // per_expert[0]
            yield np.concatenate([r.reshape(n, -1) for r in raw], axis=1)
        return
    rng = _rng(seed, plan.name)
    if plan.kind == "ssm_a":
        yield -np.exp(rng.uniform(np.log(0.02), np.log(0.5), size=plan.shape)).astype(np.float32)
        return
    if plan.kind == "norm":
        a = np.float32(1.0) + _normal(rng, plan.shape, plan.std)
        yield a.astype(np.float32)
        return
    if plan.kind == "eye_left":  # (E, 2E): [I, 0], an MTP block's eh_proj that passes the embedding on
        a = np.zeros(plan.shape, dtype=np.float32)
        a[:, :plan.shape[0]] = np.eye(plan.shape[0], dtype=np.float32)
        yield a if plan.gtype == Q.F32 else a.astype(np.float16) if plan.gtype == Q.F16 else \
            g.quants.quantize(a, plan.gtype)
        return
    outer, inner = plan.shape[0], int(np.prod(plan.shape[1:]))
    per = max(1, _CHUNK_ELEMS // inner)
    for start in range(0, outer, per):
        n = min(per, outer - start)
        if plan.gtype == Q.Q4_K:
            yield random_q4_k_blocks(rng, n * inner // QK_K, plan.std)
            continue
        if plan.gtype == Q.MXFP4:  # gpt-oss experts (p2pswarm.model.synth_gptoss)
            from p2pswarm.model.synth_gptoss import MXFP4_BLOCK, random_mxfp4_blocks

            yield random_mxfp4_blocks(rng, n * inner // MXFP4_BLOCK, plan.std)
            continue
        a = _normal(rng, (n, *plan.shape[1:]), plan.std)
        if plan.gtype == Q.F32:
            yield a
        elif plan.gtype == Q.F16:
            yield a.astype(np.float16)
        else:
            yield g.quants.quantize(a, plan.gtype)



def estimate_nbytes(plans: Sequence[TensorPlan]) -> int:
    return sum(-(-p.nbytes // 32) * 32 for p in plans)

