"""What a synthetic model's tensors are and their bytes: the plan of both architectures (name,
shape, type, scale of every tensor), random but valid Q4_K blocks, and the seeded chunked generator.

Split from ``synth.py``; the weight-scaling rule is in that module's docstring.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.synth_presets import LOGIT_STD, NORM_NOISE, _gguf

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
# Random MXFP4 (gpt-oss's experts; the format is in p2pswarm.model.synth_gptoss's docstring)

MXFP4_BLOCK = 32
MXFP4_BLOCK_BYTES = 17
# The E2M1 codes' values doubled (kvalues_mxfp4): uniform codes give rms sqrt(mean(k^2)).
_MXFP4_K = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
_MXFP4_K_RMS = float(np.sqrt(np.mean(_MXFP4_K ** 2)))


def mxfp4_e_for_std(std: float) -> float:
    """The (fractional) E8M0 exponent whose blocks have weights of standard deviation ``std``."""
    return 128.0 + float(np.log2(std / _MXFP4_K_RMS))


def random_mxfp4_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random valid MXFP4 blocks, uint8 (n_blocks, 17): uniform 4-bit codes, the
    exponent byte the floor or the ceiling of :func:`mxfp4_e_for_std` (drawn so the mean square
    matches ``std``)."""
    e_real = mxfp4_e_for_std(std)
    lo = np.floor(e_real)
    # P(hi) such that E[4^(e-128)] matches std^2 / rms^2
    p_hi = (2.0 ** (2 * (e_real - lo)) - 1.0) / 3.0
    e = (lo + (rng.random(n_blocks) < p_hi)).astype(np.uint8)
    out = np.empty((n_blocks, MXFP4_BLOCK_BYTES), dtype=np.uint8)
    out[:, 0] = e
    out[:, 1:] = np.frombuffer(rng.bytes(n_blocks * 16), dtype=np.uint8).reshape(n_blocks, 16)
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
    # A fused tensor (ffn_gate_up_exps): the plans whose bytes it concatenates, expert by expert;
    # with ``cut``: the one F32 plan whose weights ``cut(self, whole)`` cuts this tensor from.
    parts: tuple["TensorPlan", ...] = ()
    cut: Callable[["TensorPlan", np.ndarray], np.ndarray] | None = None


def plan_adder(plans: list[TensorPlan], dense: Any, exp_t: Any) -> Callable[..., None]:
    """``add(name, shape, kind, std, parts=(), cut=None)``, which appends a :class:`TensorPlan` to ``plans`` typed
    by its kind: F32 for norms, routers and vectors, ``exp_t`` for the routed experts, ``dense`` for
    the rest (what every architecture's plan does)."""
    F32 = _gguf().GGMLQuantizationType.F32

    def add(name: str, shape: tuple[int, ...], kind: str, std: float, parts: tuple[TensorPlan, ...] = (),
            cut: Callable[[TensorPlan, np.ndarray], np.ndarray] | None = None) -> None:
        t = F32 if kind in ("norm", "router", "vector") else exp_t if kind == "experts" else dense
        plans.append(TensorPlan(name, shape, kind, std, t, _type_size(t, shape), parts, cut))

    return add


def add_mtp_extras(add: Callable[..., None], prefix: str, E: int) -> None:
    """What llama.cpp's MTP (NextN) graph reads in an MTP block besides a trunk layer's tensors
    (glm4moe, qwen35moe and deepseek2 write the same four)."""
    add(prefix + "nextn.eh_proj.weight", (E, 2 * E), "matrix", 1 / np.sqrt(2 * E))
    add(prefix + "nextn.enorm.weight", (E,), "norm", NORM_NOISE)
    add(prefix + "nextn.hnorm.weight", (E,), "norm", NORM_NOISE)
    add(prefix + "nextn.shared_head_norm.weight", (E,), "norm", NORM_NOISE)


def add_output_head(add: Callable[..., None], E: int, V: int, tied: bool) -> None:
    """The output norm and, unless tied to ``token_embd``, the lm head: every plan's last tensors."""
    add("output_norm.weight", (E,), "norm", NORM_NOISE)
    if not tied:
        add("output.weight", (V, E), "matrix", LOGIT_STD / np.sqrt(E))


def _type_size(gtype: Any, shape: Sequence[int]) -> int:
    g = _gguf()
    block, size = g.GGML_QUANT_SIZES[gtype]
    n = int(np.prod(shape))
    if shape[-1] % block:
        raise UserError(f"row length {shape[-1]} is not a multiple of {block} ({gtype.name})")
    return n // block * size


# qwen35moe's DeltaNet layers write through ssm_out (the same construction serves both architectures)
RESIDUAL_WRITERS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                    "ffn_down_shexp.weight")


def agreeing_mtp(plans: list[TensorPlan], agreement: float) -> list[TensorPlan]:
    """``make-model --mtp-agreement A``: a model whose MTP block predicts what the trunk will.

    The construction: every block's writes into the residual stream (attention output, dense,
    routed and shared expert down projections) are scaled by ``1 - A``, and the MTP block's
    ``eh_proj`` is ``[I, 0]``. At ``A = 1`` the trunk's hidden state at a position is its token's
    embedding, so its next token is a fixed function ``f`` of the current token (the output head of
    the normed embedding), and the block, fed ``embed(t_{p+1})``, computes the same head of the
    same normed embedding (up to the norms' weight noise): it predicts ``f(t_{p+1})``, the trunk's
    next token. Below 1 the blocks' own contributions make the two differ more and more often;
    the acceptance it gives is measured, not promised (docs/benchmarks.md)."""
    out = []
    for t in plans:
        if t.name.endswith(RESIDUAL_WRITERS):
            t = dataclasses.replace(t, std=t.std * (1.0 - agreement))
        elif t.name.endswith("nextn.eh_proj.weight"):
            t = dataclasses.replace(t, kind="eye_left")
        out.append(t)
    return out


# Elements generated per chunk (and so the most float32 values held at once): ~16 MiB.
_CHUNK_ELEMS = 1 << 22


def _tensor_chunks(plan: TensorPlan, seed: int) -> Iterator[bytes | np.ndarray]:
    """The tensor's bytes, in order, a bounded chunk at a time. Chunking depends only on the shape."""
    g = _gguf()
    Q = g.GGMLQuantizationType
    if plan.cut is not None:  # e.g. deepseek2's split MLA tensors, cut from one F32 attn_kv_b
        whole = np.concatenate([np.asarray(c) for c in _tensor_chunks(plan.parts[0], seed)])
        part = plan.cut(plan, whole)
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

