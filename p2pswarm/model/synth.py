"""Seeded synthetic ``qwen3moe`` and ``qwen35moe`` GGUF models for ``p2pswarm make-model``, the tests
and the demo.

The weights are random but *shaped like a real model*: llama.cpp loads and runs the files, the
activations stay O(1) through the layers, and the router picks varied experts with unequal
probabilities. Every byte follows from ``(preset, dims, qtype, vocab, seed, options)``: the same
call writes the same file, byte for byte.

Weight-scaling rule (``W`` is numpy ``(out, in)``, every value is ``N(0, std)`` unless noted)::

    token_embd            std 1                      (tied: std 2/sqrt(n_embd), see below)
    attn_q / attn_k / attn_v, ffn_gate_exps / ffn_up_exps
                          std 1/sqrt(in)             -> outputs of rms ~1 from an rms-1 input
    attn_output, ffn_down_exps
                          std 1/sqrt(in)
    ffn_gate_inp (router) std 1/sqrt(n_embd)         -> router logits of std ~1
                          (router_near_tie: std 0.01/sqrt(n_embd): logits of std ~0.01, so the
                          k-th and (k+1)-th scores are close for some tokens, never equal)
    output (lm head)      std 2/sqrt(n_embd)         -> logits of std ~2
    every norm weight     1 + 0.02 * N(0, 1)

Each tensor draws from its own generator, seeded by ``(seed, crc32(tensor name))``, so a tensor's
values do not depend on which other tensors the file holds (``--layers 1`` and ``--layers 2`` share
layer 0) and writing can stream tensor by tensor.

The ``geometry-122b`` preset has the routed-expert geometry of Qwen3.5-122B-A10B (n_embd 3072,
n_ff_exp 1024, 256 experts, top-8). Its experts are written directly as random but valid Q4_K
blocks (see :func:`random_q4_k_blocks`): 5,308,416 bytes per expert (gate + up + down), the same
bytes per expert as the real model's Q4_K experts, generated and written a few experts at a time.

``arch="qwen35moe"`` writes the seed's own architecture (Qwen3.5 MoE: Gated DeltaNet layers with
every ``full_attention_interval``-th layer gated full attention, a sigmoid-gated shared expert); its
presets are in :data:`PRESETS_QWEN35` (``tiny`` and ``geometry-122b``, the latter with the 122B's
expert *and* attention/DeltaNet geometry). Extra weights, beyond the rule above::

    attn_q (q + gate), attn_qkv, attn_gate, ssm_alpha, ssm_beta, shared gate/up
                          std 1/sqrt(n_embd)
    ssm_out, shared down  std 1/sqrt(in)
    ssm_conv1d            std 1/sqrt(kernel)          (F32 always, as llama.cpp keeps it)
    ssm_a                 -exp(U(log 0.02, log 0.5))  (the stored -exp(A_log): decays 0.6..0.99)
    ssm_dt.bias           std 0.5
    ffn_gate_inp_shexp    std 1/sqrt(n_embd)          (F32: a per-token scalar gate)

With ``fused_experts`` the routed experts are one ``ffn_gate_up_exps`` tensor per layer (gate rows
first) holding *exactly* the bytes the separate gate and up tensors would hold, so a fused and a
separate model of the same seed compute the same function.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import mmap
import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from p2pswarm.engine.tokenizer import bytes_to_unicode
from p2pswarm.errors import UserError

ARCH = "qwen3moe"
ARCHES = ("qwen3moe", "qwen35moe")
SYNTH_VERSION = 1  # bump when the bytes a given set of options produces change

#: ``progress(done_bytes, total_bytes, what)``; called after every tensor and between chunks.
Progress = Callable[[int, int, str], None]

QTYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
EXPERT_QTYPES = ("q4_k",)

ROUTER_NEAR_TIE_SCALE = 0.01
NORM_NOISE = 0.02
LOGIT_STD = 2.0

# Q4_K: 256 weights in a super-block of 144 bytes (f16 d, f16 dmin, 12 bytes of 6-bit
# scales/mins for 8 sub-blocks of 32, 128 bytes of 4-bit quants).
QK_K = 256
Q4_K_BLOCK_BYTES = 144
# Sub-block scales drawn uniformly from this range (6-bit); mins equal the scales, dmin = 7.5 d,
# so a weight is d * sc * (q - 7.5): zero mean, std d * rms(sc) * std(q).
_Q4K_SC_LO, _Q4K_SC_HI = 32, 63
_Q4K_Q_STD = float(np.sqrt((16 * 16 - 1) / 12.0))  # std of a uniform 4-bit quant (4.61)
_Q4K_SC_RMS = float(np.sqrt(np.mean(np.arange(_Q4K_SC_LO, _Q4K_SC_HI + 1, dtype=np.float64) ** 2)))


@dataclasses.dataclass(frozen=True)
class Preset:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    expert_qtype: str | None = None  # None: the experts follow ``qtype``


PRESETS: dict[str, Preset] = {
    # Makes in about a second; every dim a multiple of 256 so K-quants apply.
    "tiny": Preset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                   n_expert_used=4, n_ff_exp=256, context_length=512),
    # The routed-expert geometry of Qwen3.5-122B-A10B; attention is plain qwen3moe attention.
    "geometry-122b": Preset(n_embd=3072, n_head=32, n_head_kv=2, head_dim=128, n_layer=2,
                            n_expert=256, n_expert_used=8, n_ff_exp=1024, context_length=4096,
                            expert_qtype="q4_k"),
}



@dataclasses.dataclass(frozen=True)
class Qwen35Preset(Preset):
    """A qwen35moe shape: the qwen3moe fields plus partial IMROPE, the DeltaNet and the shared expert."""

    n_rot: int = 16  # rotated dims per head (Qwen3.5: head_dim / 4)
    rope_sections: tuple[int, ...] = (3, 3, 2, 0)  # IMROPE (t, h, w, e) sections, in pairs
    ssm_state_size: int = 32  # d: DeltaNet head size (k and v)
    ssm_group_count: int = 2  # Hk: q/k heads
    ssm_time_step_rank: int = 4  # Hv: v heads (a multiple of Hk)
    ssm_conv_kernel: int = 4
    full_attention_interval: int = 4  # every 4th layer is full attention, the others DeltaNet
    n_ff_shexp: int = 256  # shared expert's hidden size
    fused_experts: bool = False  # one ffn_gate_up_exps tensor instead of ffn_gate_exps + ffn_up_exps


PRESETS_QWEN35: dict[str, Qwen35Preset] = {
    # Makes in about a second: 3 DeltaNet layers + 1 full-attention layer, Hk 2 != Hv 4 like the
    # real model (16 != 64), sections covering all 8 rotary pairs like the real [11, 11, 10, 0].
    "tiny": Qwen35Preset(n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_layer=4, n_expert=16,
                         n_expert_used=4, n_ff_exp=256, context_length=512,
                         rope_freq_base=10_000_000.0),
    # Qwen3.5-122B-A10B's geometry, every part of a layer: experts (3072, 256 top-8, 1024, Q4_K),
    # shared expert 1024, gated attention 32/2 heads of 256 with 64 rotary dims, DeltaNet 16 q/k
    # and 64 v heads of 128, conv 4. Two layers: one DeltaNet, one full attention.
    "geometry-122b": Qwen35Preset(n_embd=3072, n_head=32, n_head_kv=2, head_dim=256, n_layer=2,
                                  n_expert=256, n_expert_used=8, n_ff_exp=1024, context_length=4096,
                                  rope_freq_base=10_000_000.0, expert_qtype="q4_k", n_rot=64,
                                  rope_sections=(11, 11, 10, 0), ssm_state_size=128,
                                  ssm_group_count=16, ssm_time_step_rank=64, full_attention_interval=2,
                                  n_ff_shexp=1024),
}

PRESETS_BY_ARCH: dict[str, dict[str, Preset]] = {"qwen3moe": PRESETS, "qwen35moe": PRESETS_QWEN35}

# make_model keywords that only a qwen35moe shape has.
QWEN35_OPTIONS = ("n_rot", "rope_sections", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank",
                  "ssm_conv_kernel", "full_attention_interval", "n_ff_shexp", "fused_experts")

# Built-in vocabulary: 256 byte tokens, the merges BPE training finds in BUILTIN_TEXT (at most
# BUILTIN_MERGES; pairs must occur twice: 281 with this text, so 540 tokens), 3 special tokens.
BUILTIN_MERGES = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# llama.cpp's "qwen2" pre-tokenizer split; the merges are trained on pieces split the same way.
QWEN2_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

BUILTIN_TEXT = """\
A swarm is many small things acting as one large thing. A single bee cannot build a hive, and a
single phone cannot hold a model with a hundred billion weights, but a few thousand of them, each
holding a small part, can serve the whole model together. The model we care about is a mixture of
experts. In every layer a router looks at the hidden state of each token and picks the few experts
that should work on it. The other experts sleep. That is why the model is cheap to run even though
it is large to store: most of the weight is in the experts, and each token only wakes eight of them.

The experts of one layer do not talk to each other. Each is a small feed-forward network with a
gate, an up and a down projection. Because the expert index is the outermost dimension of the
tensors that hold them, every expert is one contiguous range of bytes in the file. Cutting the model
into shards is therefore a copy of byte ranges, with no need to decode or repack the quantised
blocks. A worker that owns sixty-four experts of layer five downloads exactly those bytes and
nothing else.

The backbone keeps the attention, the key and value cache, the norms and the router. It runs the
router once for each token and layer, and its choice is final. It then sends the normed hidden rows
to the workers that own the chosen experts, waits for their answers, and adds them up in a fixed
order, so that the result is the same whatever the order in which the answers arrive. When a worker
is slow, gone or wrong, the backbone computes the missing experts itself from its own copy.

Nodes find each other through a distributed hash table. A node that owns some experts writes a
record under the key of each shard it covers, and a backbone that needs an expert looks up that key
and dials one of the owners. Phones behind carrier-grade address translation cannot accept calls,
so both sides dial out to a relay on port four hundred forty-three, which joins the two streams.
Every frame carries a length of sixty-four bits, because a length that silently wraps at sixteen
or thirty-two bits corrupts large frames without any error.

Nodes are paid for the work they do. The demand for each expert is measured, the coverage of each
shard is counted, and a new node enrols in the shard with the highest reward: the one that is most
wanted and least covered. Tokens prove what a node may fetch; receipts record what it served. The
backbone checks a sample of the answers it receives by computing them again on its own replica.

Tokens per second is the measure. One round trip across the internet costs far more than the
arithmetic of an expert, so the backbone sends many rows at once, keeps the hottest experts close,
and prefers the replicas that are nearest. The quick brown fox jumps over the lazy dog; numbers
like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 256, 1024 and 3072 appear in the text as well.
"""

# ---------------------------------------------------------------------------------------------
# Small helpers


def _gguf():
    import gguf  # noqa: PLC0415 (import cost only when a model is made)

    return gguf


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), zlib.crc32(name.encode())]))


def _normal(rng: np.random.Generator, shape: Sequence[int], std: float) -> np.ndarray:
    a = rng.standard_normal(size=tuple(shape), dtype=np.float32)
    a *= np.float32(std)
    return a


# ---------------------------------------------------------------------------------------------
# Vocabulary


@dataclasses.dataclass
class KV:
    """One metadata key with its exact GGUF type (and element type for arrays)."""

    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None


@functools.lru_cache(maxsize=1)
def builtin_vocab() -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """``(tokens, token_types, merges)`` of the small built-in byte-level BPE vocabulary.

    Token ids: 0..255 are the bytes 0..255 (as GPT-2 byte-to-unicode characters), then one token
    per merge in merge order, then the special tokens. Deterministic.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=256 + BUILTIN_MERGES,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(BUILTIN_TEXT.splitlines(keepends=True), trainer)
    raw_merges = json.loads(tok.to_str())["model"]["merges"]
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    for m in raw_merges:
        a, b = (m if isinstance(m, (list, tuple)) else m.split(" ", 1))
        if a not in known or b not in known or (a + b) in known:
            raise RuntimeError(f"unexpected BPE merge from the trainer: {a!r} {b!r}")
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    types = [1] * len(tokens)  # NORMAL
    tokens += SPECIAL_TOKENS
    types += [3] * len(SPECIAL_TOKENS)  # CONTROL
    return tuple(tokens), tuple(types), tuple(merges)


def builtin_tokenizer_kv() -> list[KV]:
    g = _gguf()
    T = g.GGUFValueType
    tokens, types, merges = builtin_vocab()
    eot = tokens.index("<|endoftext|>")
    return [
        KV("tokenizer.ggml.model", "gpt2", T.STRING),
        KV("tokenizer.ggml.pre", "qwen2", T.STRING),
        KV("tokenizer.ggml.tokens", list(tokens), T.ARRAY, T.STRING),
        KV("tokenizer.ggml.token_type", list(types), T.ARRAY, T.INT32),
        KV("tokenizer.ggml.merges", list(merges), T.ARRAY, T.STRING),
        KV("tokenizer.ggml.eos_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.padding_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.bos_token_id", eot, T.UINT32),
        KV("tokenizer.ggml.add_bos_token", False, T.BOOL),
        KV("tokenizer.chat_template", CHATML_TEMPLATE, T.STRING),
    ]


_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
             10: "<u8", 11: "<i8", 12: "<f8"}


@dataclasses.dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first
    gtype: int  # GGML type id
    offset: int  # from the start of the data section


def read_gguf_header(path: str | os.PathLike[str]) -> tuple[list[KV], list[TensorInfo]]:
    """Every metadata key (types preserved) and tensor info of a GGUF file, read via mmap.

    Fast even for a 150k-token vocabulary, and reads only the header of a large model. Strings
    (also inside arrays) come back as ``bytes`` so they can be copied exactly.
    Raises :class:`UserError` for a missing, unreadable or malformed file.
    """
    g = _gguf()
    T = g.GGUFValueType
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise UserError(f"bad GGUF file {path}: it is empty")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse_header(data, T)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
        raise UserError(f"bad GGUF file {path}: {exc}") from None


def _parse_header(data: Any, T: Any) -> tuple[list[KV], list[TensorInfo]]:
    pos = 0
    end = len(data)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > end:
            raise ValueError("truncated header")
        b = data[pos:pos + n]
        pos += n
        return b

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def string() -> bytes:
        return take(u64())

    if take(4) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version = u32()
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = u64(), u64()
    kvs: list[KV] = []
    for _ in range(n_kv):
        key = string().decode("utf-8")
        t = u32()
        if t == 8:
            kvs.append(KV(key, string(), T.STRING))
        elif t == 9:
            st, n = u32(), u64()
            if st == 8:
                items: list[Any] = [string() for _ in range(n)]
            elif st in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[st])
                arr = np.frombuffer(take(n * dt.itemsize), dtype=dt)
                items = [bool(x) for x in arr] if st == 7 else arr.tolist()
            else:
                raise ValueError(f"unsupported array element type {st} in {key}")
            kvs.append(KV(key, items, T.ARRAY, T(st)))
        elif t in _SCALAR_FMT:
            fmt = _SCALAR_FMT[t]
            kvs.append(KV(key, struct.unpack(fmt, take(struct.calcsize(fmt)))[0], T(t)))
        else:
            raise ValueError(f"unknown value type {t} for {key}")
    tis: list[TensorInfo] = []
    for _ in range(n_tensors):
        name = string().decode("utf-8")
        nd = u32()
        ne = [u64() for _ in range(nd)]
        t = u32()
        off = u64()
        tis.append(TensorInfo(name, tuple(reversed(ne)), t, off))
    return kvs, tis


def read_gguf_kv(path: str | os.PathLike[str]) -> list[KV]:
    """Every metadata key of a GGUF file (see :func:`read_gguf_header`)."""
    return read_gguf_header(path)[0]


def vocab_tokenizer_kv(path: str | os.PathLike[str]) -> list[KV]:
    """The ``tokenizer.ggml.*`` keys (and ``tokenizer.chat_template``) of another GGUF file."""
    try:
        all_kv = read_gguf_kv(path)
    except UserError as exc:
        raise UserError(f"vocabulary: {exc}") from None
    kvs = [kv for kv in all_kv
           if kv.key.startswith("tokenizer.ggml.") or kv.key == "tokenizer.chat_template"]
    keys = {kv.key: kv for kv in kvs}
    for need in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if need not in keys:
            raise UserError(f"bad vocabulary file {path}: it has no {need}")
    if keys["tokenizer.ggml.model"].value not in (b"gpt2",):
        raise UserError(
            f"bad vocabulary file {path}: tokenizer.ggml.model is "
            f"{keys['tokenizer.ggml.model'].value.decode(errors='replace')!r}; only BPE ('gpt2') "
            "vocabularies are supported")
    n = len(keys["tokenizer.ggml.tokens"].value)
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.padding_token_id"):
        if k in keys and not 0 <= int(keys[k].value) < n:
            raise UserError(f"bad vocabulary file {path}: {k} {keys[k].value} is not below {n}")
    return kvs


def _n_vocab(tok_kv: list[KV]) -> int:
    return len(next(kv.value for kv in tok_kv if kv.key == "tokenizer.ggml.tokens"))


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

    def add(name: str, shape: tuple[int, ...], kind: str, std: float) -> None:
        if kind in ("norm", "router"):
            t = Q.F32
        elif kind == "experts":
            t = exp_t
        else:
            t = dense
        plans.append(TensorPlan(name, shape, kind, std, t, _type_size(t, shape)))

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
    for i in range(dims.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (E,), "norm", NORM_NOISE)
        if (i + 1) % dims.full_attention_interval != 0:  # Gated DeltaNet
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
    outer, inner = plan.shape[0], int(np.prod(plan.shape[1:]))
    per = max(1, _CHUNK_ELEMS // inner)
    for start in range(0, outer, per):
        n = min(per, outer - start)
        if plan.gtype == Q.Q4_K:
            yield random_q4_k_blocks(rng, n * inner // QK_K, plan.std)
            continue
        a = _normal(rng, (n, *plan.shape[1:]), plan.std)
        if plan.gtype == Q.F32:
            yield a
        elif plan.gtype == Q.F16:
            yield a.astype(np.float16)
        else:
            yield g.quants.quantize(a, plan.gtype)


# ---------------------------------------------------------------------------------------------
# Writing


def _resolve(preset: str, layers: int | None, overrides: dict[str, Any],
             presets: dict[str, Preset] = PRESETS) -> Preset:
    if preset not in presets:
        raise UserError(f"unknown preset {preset!r}; choose one of: {', '.join(presets)}")
    p = presets[preset]
    if layers is not None:
        overrides = {**overrides, "n_layer": layers}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(p, **overrides)


def _validate(p: Preset, qtype: str, expert_qtype: str | None) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    need(qtype in QTYPES, f"unknown type {qtype!r}; choose one of: {', '.join(QTYPES)}")
    need(expert_qtype in (None, *EXPERT_QTYPES),
         f"unknown expert type {expert_qtype!r}; choose one of: {', '.join(EXPERT_QTYPES)}")
    for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_layer", "n_expert",
                 "n_expert_used", "n_ff_exp", "context_length"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name.replace('n_layer', 'layers')} must be a positive integer, got {v!r}")
    need(p.n_layer <= 512, f"layers must be at most 512, got {p.n_layer}")
    need(p.n_expert <= 1024, f"n_expert must be at most 1024 (llama.cpp's limit), got {p.n_expert}")
    need(p.n_expert_used <= p.n_expert,
         f"n_expert_used ({p.n_expert_used}) must not exceed n_expert ({p.n_expert})")
    need(p.n_head % p.n_head_kv == 0,
         f"n_head ({p.n_head}) must be a multiple of n_head_kv ({p.n_head_kv})")
    need(p.head_dim % 2 == 0, f"head_dim must be even (RoPE), got {p.head_dim}")
    block = 32
    if qtype == "q4_k_m" or expert_qtype == "q4_k":
        block = 256
    elif qtype in ("f32", "f16", "bf16"):
        block = 1
    for name in ("n_embd", "n_ff_exp"):
        v = getattr(p, name)
        need(v % block == 0, f"{name} ({v}) must be a multiple of {block} for this type")
    if qtype == "q4_k_m":
        need(expert_qtype is None,
             "--type q4_k_m quantises every tensor with llama.cpp; it cannot be combined with "
             "directly written Q4_K experts (use --type f32, f16 or q8_0 for the dense tensors)")


def _validate_qwen35(p: Qwen35Preset, qtype: str) -> None:
    """The qwen35moe-only constraints, each a one-line UserError (llama.cpp would abort on most)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    for name in ("n_rot", "ssm_state_size", "ssm_group_count", "ssm_time_step_rank", "ssm_conv_kernel",
                 "full_attention_interval", "n_ff_shexp"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name} must be a positive integer, got {v!r}")
    need(p.n_rot % 2 == 0 and p.n_rot <= p.head_dim,
         f"n_rot ({p.n_rot}) must be even and at most head_dim ({p.head_dim})")
    sec = p.rope_sections
    need(isinstance(sec, tuple) and len(sec) == 4
         and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sec) and sum(sec) > 0,
         f"rope sections must be 4 non-negative integers with a positive sum, got {sec!r}")
    need(p.ssm_time_step_rank % p.ssm_group_count == 0,
         f"ssm_time_step_rank (Hv {p.ssm_time_step_rank}) must be a multiple of ssm_group_count "
         f"(Hk {p.ssm_group_count})")
    need(p.ssm_conv_kernel >= 2, f"ssm_conv_kernel must be at least 2, got {p.ssm_conv_kernel}")
    need(p.ssm_conv_kernel <= 16, f"ssm_conv_kernel must be at most 16, got {p.ssm_conv_kernel}")
    if qtype in ("q8_0", "q4_k_m"):
        for name, v in (("n_ff_shexp", p.n_ff_shexp), ("n_head * head_dim", p.n_head * p.head_dim),
                        ("ssm_time_step_rank * ssm_state_size", p.ssm_time_step_rank * p.ssm_state_size)):
            need(v % 32 == 0, f"{name} ({v}) must be a multiple of 32 for this type")


def _file_type(qtype: str, expert_qtype: str | None) -> int:
    g = _gguf()
    F = g.LlamaFileType
    if expert_qtype == "q4_k":
        return int(F.MOSTLY_Q4_K_M)  # by bytes the file is almost all Q4_K experts
    return int({"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0,
                "q4_k_m": F.ALL_F32}[qtype])


def estimate_nbytes(plans: Sequence[TensorPlan]) -> int:
    return sum(-(-p.nbytes // 32) * 32 for p in plans)


def _write_gguf(path: Path, dims: Preset, plans: list[TensorPlan], tok_kv: list[KV], *, preset: str,
                seed: int, qtype: str, expert_qtype: str | None, tied: bool,
                router_near_tie: bool, progress: Progress | None, arch: str = ARCH) -> None:
    g = _gguf()
    with _quiet_logger("gguf.gguf_writer"):
        w = g.GGUFWriter(path, arch)
    try:
        w.add_type("model")
        w.add_name(f"p2pswarm synth {preset}")
        w.add_description(f"random-weight {arch} made by p2pswarm make-model (seed {seed})")
        w.add_context_length(dims.context_length)
        w.add_embedding_length(dims.n_embd)
        w.add_block_count(dims.n_layer)
        w.add_feed_forward_length(dims.n_ff_exp * dims.n_expert_used)
        w.add_head_count(dims.n_head)
        w.add_head_count_kv(dims.n_head_kv)
        w.add_key_length(dims.head_dim)
        w.add_value_length(dims.head_dim)
        w.add_rope_freq_base(dims.rope_freq_base)
        w.add_layer_norm_rms_eps(dims.rms_eps)
        w.add_expert_count(dims.n_expert)
        w.add_expert_used_count(dims.n_expert_used)
        w.add_expert_feed_forward_length(dims.n_ff_exp)
        if isinstance(dims, Qwen35Preset):
            w.add_expert_shared_feed_forward_length(dims.n_ff_shexp)
            w.add_rope_dimension_count(dims.n_rot)
            w.add_rope_dimension_sections(list(dims.rope_sections))
            w.add_ssm_conv_kernel(dims.ssm_conv_kernel)
            w.add_ssm_inner_size(dims.ssm_time_step_rank * dims.ssm_state_size)
            w.add_ssm_state_size(dims.ssm_state_size)
            w.add_ssm_time_step_rank(dims.ssm_time_step_rank)
            w.add_ssm_group_count(dims.ssm_group_count)
            w.add_full_attention_interval(dims.full_attention_interval)
        w.add_file_type(_file_type(qtype, expert_qtype))
        if any(p.gtype not in (g.GGMLQuantizationType.F32, g.GGMLQuantizationType.F16)
               for p in plans):
            w.add_quantization_version(g.GGML_QUANT_VERSION)
        w.add_string("p2pswarm.synth.preset", preset)
        w.add_uint64("p2pswarm.synth.seed", seed)
        w.add_uint32("p2pswarm.synth.version", SYNTH_VERSION)
        w.add_bool("p2pswarm.synth.tied", tied)
        w.add_bool("p2pswarm.synth.router_near_tie", router_near_tie)
        if isinstance(dims, Qwen35Preset):
            w.add_bool("p2pswarm.synth.fused_experts", dims.fused_experts)
        for kv in tok_kv:
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for p in plans:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.gtype)
        with _quiet_logger("gguf.gguf_writer"):
            w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        f = w.fout[0]
        align = w.data_alignment

        def pad() -> None:
            r = f.tell() % align
            if r:
                f.write(b"\0" * (align - r))

        pad()
        total = estimate_nbytes(plans)
        done = 0
        for p in plans:
            written = 0
            for chunk in _tensor_chunks(p, seed):
                buf = chunk.tobytes() if isinstance(chunk, np.ndarray) else chunk
                f.write(buf)
                written += len(buf)
                if progress is not None and written < p.nbytes:
                    progress(done + written, total, p.name)
            if written != p.nbytes:
                raise RuntimeError(f"{p.name}: wrote {written} bytes, expected {p.nbytes}")
            pad()
            done += -(-p.nbytes // align) * align
            if progress is not None:
                progress(done, total, p.name)
        f.flush()
        os.fsync(f.fileno())
    finally:
        w.close()


def _quantize_q4_k_m(src: Path, dst: Path) -> None:
    try:
        import llama_cpp  # noqa: PLC0415
    except ImportError:
        raise UserError(
            "--type q4_k_m needs llama.cpp's quantiser: pip install 'p2pswarm[llama]'") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = min(4, os.cpu_count() or 1)
    with _quiet_stderr():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                            llama_cpp.byref(params))
    if rc != 0:
        raise UserError(f"llama.cpp could not quantise the model to Q4_K_M (error {rc})")


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Drop a library logger's INFO chatter (gguf's writer announces endianness and its plan)."""
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(old)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence llama.cpp's C-level logging (fd 2) for the duration."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(fd, 2)
    finally:
        os.close(fd)


def _tmp_name(out: Path, tag: str) -> Path:
    return out.with_name(f".{out.name}.{tag}-{os.getpid()}.tmp")


def make_model(
    out_path: str | os.PathLike[str],
    *,
    preset: str = "tiny",
    layers: int | None = None,
    qtype: str = "f32",
    vocab: str | os.PathLike[str] | None = None,
    seed: int = 0,
    tied: bool | None = None,
    router_near_tie: bool = False,
    progress: Progress | None = None,
    expert_qtype: str | None = None,
    n_embd: int | None = None,
    n_head: int | None = None,
    n_head_kv: int | None = None,
    head_dim: int | None = None,
    n_expert: int | None = None,
    n_expert_used: int | None = None,
    n_ff_exp: int | None = None,
    context_length: int | None = None,
    arch: str = ARCH,
    n_rot: int | None = None,
    rope_sections: Sequence[int] | None = None,
    ssm_state_size: int | None = None,
    ssm_group_count: int | None = None,
    ssm_time_step_rank: int | None = None,
    ssm_conv_kernel: int | None = None,
    full_attention_interval: int | None = None,
    n_ff_shexp: int | None = None,
    fused_experts: bool | None = None,
) -> Path:
    """Write a seeded random-weight qwen3moe (or qwen35moe) GGUF to ``out_path`` and return its path.

    ``preset``: ``tiny`` or ``geometry-122b`` (see :data:`PRESETS`); ``layers`` and the ``n_*``
    keywords override the preset's dims. ``qtype``: ``f32``, ``f16``, ``q8_0`` (2-D/3-D weight
    matrices Q8_0; norms and the router stay F32) or ``q4_k_m`` (llama.cpp's quantiser, needs
    llama-cpp-python). ``expert_qtype="q4_k"`` writes the routed experts directly as random Q4_K
    blocks (the default of ``geometry-122b``). ``vocab``: a GGUF whose ``tokenizer.ggml.*`` keys
    are copied (else a small built-in byte-level BPE vocabulary). ``tied``: no ``output.weight``,
    the lm head is ``token_embd``; by default tied only when the vocabulary exceeds 32,768 tokens
    (keeps a 151,936-token demo model small). ``router_near_tie``: router weights 100x smaller, so
    top-k margins are small but not zero.

    ``arch``: ``qwen3moe`` (default) or ``qwen35moe`` (presets :data:`PRESETS_QWEN35`). Only for
    qwen35moe: ``n_rot`` (rotated dims per head), ``rope_sections`` (4 IMROPE sections),
    ``ssm_state_size`` (d), ``ssm_group_count`` (Hk), ``ssm_time_step_rank`` (Hv, a multiple of
    Hk), ``ssm_conv_kernel``, ``full_attention_interval``, ``n_ff_shexp`` (shared expert) and
    ``fused_experts`` (one ``ffn_gate_up_exps`` per layer, same weights as the separate tensors).

    The file appears atomically: it is written under a temporary name in the same directory and
    renamed at the end; a failure leaves nothing behind.
    """
    out = Path(out_path)
    if arch not in ARCHES:
        raise UserError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHES)}")
    extra = dict(n_rot=n_rot, rope_sections=None if rope_sections is None else tuple(rope_sections),
                 ssm_state_size=ssm_state_size, ssm_group_count=ssm_group_count,
                 ssm_time_step_rank=ssm_time_step_rank, ssm_conv_kernel=ssm_conv_kernel,
                 full_attention_interval=full_attention_interval, n_ff_shexp=n_ff_shexp,
                 fused_experts=fused_experts)
    if arch != "qwen35moe":
        given = [k for k, v in extra.items() if v is not None]
        if given:
            raise UserError(f"{given[0]} applies only to --arch qwen35moe")
        extra = {}
    p = _resolve(preset, layers, dict(
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_expert=n_expert,
        n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, context_length=context_length, **extra),
        PRESETS_BY_ARCH[arch])
    if expert_qtype is None:
        expert_qtype = p.expert_qtype
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise UserError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if preset == "geometry-122b" and qtype == "q4_k_m" and expert_qtype == "q4_k":
        raise UserError("geometry-122b writes its experts as Q4_K directly; use --type f32, f16 or "
                        "q8_0 for its dense tensors (q4_k_m would requantise the experts)")
    _validate(p, qtype, expert_qtype)
    if isinstance(p, Qwen35Preset):
        _validate_qwen35(p, qtype)

    if out.is_dir():
        raise UserError(f"output {out} is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"output directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory {parent} is not writable")

    tok_kv = vocab_tokenizer_kv(vocab) if vocab is not None else builtin_tokenizer_kv()
    n_vocab = _n_vocab(tok_kv)
    if tied is None:
        tied = n_vocab > 32768
    dims = p
    planner = _plan_qwen35 if isinstance(dims, Qwen35Preset) else _plan
    plans = planner(dims, n_vocab, qtype, expert_qtype, bool(tied), router_near_tie)

    need_bytes = estimate_nbytes(plans) * (2 if qtype == "q4_k_m" else 1) + (64 << 20)
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        free = None
    if free is not None and free < need_bytes:
        raise UserError(f"not enough disk space in {parent}: need about {need_bytes / 1e9:.1f} GB, "
                        f"{free / 1e9:.1f} GB free")

    tmp = _tmp_name(out, "part")
    tmp_f32 = _tmp_name(out, "f32")
    try:
        write_to = tmp_f32 if qtype == "q4_k_m" else tmp
        _write_gguf(write_to, dims, plans, tok_kv, preset=preset, seed=seed, qtype=qtype,
                    expert_qtype=expert_qtype, tied=bool(tied), router_near_tie=router_near_tie,
                    progress=progress, arch=arch)
        if qtype == "q4_k_m":
            if progress is not None:
                progress(0, 1, "quantising to Q4_K_M with llama.cpp")
            _quantize_q4_k_m(tmp_f32, tmp)
            tmp_f32.unlink()
        os.replace(tmp, out)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        for t in (tmp, tmp_f32):
            with contextlib.suppress(FileNotFoundError):
                t.unlink()
    return out


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Facts about a qwen3moe/qwen35moe GGUF (read from its header only): dims, n_vocab, bytes per
    expert (fused or not)."""
    g = _gguf()
    kvs, tis = read_gguf_header(path)
    kv = {k.key: k.value for k in kvs}

    def val(key: str) -> Any:
        v = kv.get(key)
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else v

    arch = val("general.architecture") or ARCH  # the key prefix

    n_expert = int(val(f"{arch}.expert_count") or 0)
    per_expert = 0
    types: set[str] = set()
    for t in tis:
        if t.name.startswith("blk.0.") and "_exps." in t.name and n_expert:
            gt = g.GGMLQuantizationType(t.gtype)
            per_expert += _type_size(gt, t.shape) // n_expert
            types.add(gt.name)
    tokens = kv.get("tokenizer.ggml.tokens")
    return {
        "architecture": val("general.architecture"),
        "preset": val("p2pswarm.synth.preset"),
        "seed": val("p2pswarm.synth.seed"),
        "n_layer": val(f"{arch}.block_count"),
        "n_embd": val(f"{arch}.embedding_length"),
        "n_expert": n_expert,
        "n_expert_used": val(f"{arch}.expert_used_count"),
        "n_ff_exp": val(f"{arch}.expert_feed_forward_length"),
        "n_vocab": len(tokens) if tokens is not None else None,
        "tied": not any(t.name == "output.weight" for t in tis),
        "expert_types": sorted(types),
        "fused_experts": any(t.name.endswith("ffn_gate_up_exps.weight") for t in tis),
        "bytes_per_expert": per_expert,
        "file_bytes": os.path.getsize(path),
    }
