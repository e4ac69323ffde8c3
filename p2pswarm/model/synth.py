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
blocks (see :func:`~p2pswarm.model.synth_tensors.random_q4_k_blocks`): 5,308,416 bytes per expert
(gate + up + down), the same bytes per expert as the real model's Q4_K experts, generated and
written a few experts at a time.

``arch="qwen35moe"`` writes the seed's own architecture (Qwen3.5 MoE: Gated DeltaNet layers with
every ``full_attention_interval``-th layer gated full attention, a sigmoid-gated shared expert); its
presets are in :data:`~p2pswarm.model.synth_qwen35moe.PRESETS_QWEN35` (``tiny`` and
``geometry-122b``, the latter with the 122B's expert *and* attention/DeltaNet geometry). Extra weights, beyond the rule above::

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

The pieces: :mod:`~p2pswarm.model.synth_arches` (what an architecture's preset provides, the
:class:`~p2pswarm.model.synth_arches.SynthPreset` protocol, and the registry), one module per
architecture (``synth_qwen3moe``, ``synth_qwen35moe``, ``synth_gptoss``, ``synth_glm4moe``,
``synth_deepseek2``: presets, keys, checks, tensor plan), :mod:`~p2pswarm.model.synth_vocab` (the BPE
vocabulary), :mod:`~p2pswarm.model.synth_tensors` (the plan's type and the seeded bytes),
:mod:`~p2pswarm.model.gguf_read` (reading a GGUF back); this module writes the file through the
protocol (it names no architecture's class) and quantises it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.model.gguf_read import KV, read_gguf_header
from p2pswarm.model.synth_arches import ARCHES, DEFAULT_ARCH, PRESETS_BY_ARCH, SynthPreset, resolve, taking, validate_common
from p2pswarm.model.synth_presets import SYNTH_VERSION, Progress, _file_type, _gguf
from p2pswarm.model.synth_tensors import TensorPlan, _tensor_chunks, _type_size, agreeing_mtp, estimate_nbytes
from p2pswarm.model.synth_vocab import _n_vocab, builtin_tokenizer_kv, vocab_tokenizer_kv

# ---------------------------------------------------------------------------------------------
# Writing


def _write_gguf(path: Path, dims: SynthPreset, plans: list[TensorPlan], tok_kv: list[KV], *, preset: str,
                seed: int, qtype: str, expert_qtype: str | None, tied: bool,
                router_near_tie: bool, progress: Progress | None, arch: str = DEFAULT_ARCH) -> None:
    g = _gguf()
    with _quiet_logger("gguf.gguf_writer"):
        w = g.GGUFWriter(path, arch)
    try:
        w.add_type("model")
        w.add_name(f"p2pswarm synth {preset}")
        w.add_description(f"random-weight {arch} made by p2pswarm make-model (seed {seed})")
        dims.write_keys(w)
        w.add_file_type(_file_type(qtype, expert_qtype))
        if any(p.gtype not in (g.GGMLQuantizationType.F32, g.GGMLQuantizationType.F16)
               for p in plans):
            w.add_quantization_version(g.GGML_QUANT_VERSION)
        w.add_string("p2pswarm.synth.preset", preset)
        w.add_uint64("p2pswarm.synth.seed", seed)
        w.add_uint32("p2pswarm.synth.version", SYNTH_VERSION)
        w.add_bool("p2pswarm.synth.tied", tied)
        w.add_bool("p2pswarm.synth.router_near_tie", router_near_tie)
        dims.write_synth_keys(w)
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


def _quantize_q4_k_m(src: Path, dst: Path, requantize: bool = False) -> None:
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "--type q4_k_m needs llama.cpp's quantiser: pip install 'p2pswarm[llama]'") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = requantize  # experts written as Q4_K: copied, or moved to Q6_K where Q4_K_M wants
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
    arch: str = DEFAULT_ARCH,
    n_rot: int | None = None,
    rope_sections: Sequence[int] | None = None,
    ssm_state_size: int | None = None,
    ssm_group_count: int | None = None,
    ssm_time_step_rank: int | None = None,
    ssm_conv_kernel: int | None = None,
    full_attention_interval: int | None = None,
    n_ff_shexp: int | None = None,
    fused_experts: bool | None = None,
    sliding_window: int | None = None,
    options: dict[str, Any] | None = None,
    mtp_agreement: float | None = None,
    n_nextn: int | None = None,
) -> Path:
    """Write a seeded random-weight qwen3moe (or qwen35moe) GGUF to ``out_path`` and return its path.

    ``preset``: ``tiny`` or ``geometry-122b`` (see :data:`~p2pswarm.model.synth_qwen3moe.PRESETS`); ``layers`` and the ``n_*``
    keywords override the preset's dims. ``qtype``: ``f32``, ``f16``, ``q8_0`` (2-D/3-D weight
    matrices Q8_0; norms and the router stay F32) or ``q4_k_m`` (llama.cpp's quantiser, needs
    llama-cpp-python). ``expert_qtype="q4_k"`` writes the routed experts directly as random Q4_K
    blocks (the default of ``geometry-122b``). ``vocab``: a GGUF whose ``tokenizer.ggml.*`` keys
    are copied (else a small built-in byte-level BPE vocabulary). ``tied``: no ``output.weight``,
    the lm head is ``token_embd``; by default tied only when the vocabulary exceeds 32,768 tokens
    (keeps a 151,936-token demo model small). ``router_near_tie``: router weights 100x smaller, so
    top-k margins are small but not zero.

    ``arch``: ``qwen3moe`` (default) or ``qwen35moe`` (presets
    :data:`~p2pswarm.model.synth_qwen35moe.PRESETS_QWEN35`). Only for
    qwen35moe: ``n_rot`` (rotated dims per head), ``rope_sections`` (4 IMROPE sections),
    ``ssm_state_size`` (d), ``ssm_group_count`` (Hk), ``ssm_time_step_rank`` (Hv, a multiple of
    Hk), ``ssm_conv_kernel``, ``full_attention_interval``, ``n_ff_shexp`` (shared expert) and
    ``fused_experts`` (one ``ffn_gate_up_exps`` per layer, same weights as the separate tensors).

    ``options``: the architecture's own options dict, for one that takes it (``options`` in its
    preset's ``KEYWORDS``): deepseek2's (presets ``tiny`` and ``geometry-671b``) is a dict of
    :class:`~p2pswarm.model.synth_deepseek2.DeepSeek2Preset` fields to override (MLA ranks, the
    split or unsplit MLA tensors, gating, groups, YaRN, ...).

    ``mtp_agreement`` (glm4moe, qwen35moe and deepseek2, 0..1): a model whose MTP block agrees with
    the trunk, so speculative decoding's acceptance can be measured on random weights
    (:func:`~p2pswarm.model.synth_tensors.agreeing_mtp`); for qwen35moe and deepseek2 it implies
    ``n_nextn=1``. ``n_nextn`` (qwen35moe and deepseek2): MTP (NextN) blocks written after the trunk
    (default 0; llama.cpp runs one).

    The file appears atomically: it is written under a temporary name in the same directory and
    renamed at the end; a failure leaves nothing behind.
    """
    out = Path(out_path)
    if arch not in ARCHES:
        raise UserError(f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHES)}")
    presets = PRESETS_BY_ARCH[arch]
    takes = next(iter(presets.values())).KEYWORDS
    # the keywords only some architectures take, checked in this order (KEYWORDS says who takes which)
    own: dict[str, Any] = dict(
        sliding_window=sliding_window, options=options, n_rot=n_rot,
        rope_sections=None if rope_sections is None else tuple(rope_sections),
        ssm_state_size=ssm_state_size, ssm_group_count=ssm_group_count, ssm_time_step_rank=ssm_time_step_rank,
        ssm_conv_kernel=ssm_conv_kernel, full_attention_interval=full_attention_interval, n_ff_shexp=n_ff_shexp,
        fused_experts=fused_experts, n_nextn=n_nextn)
    if "n_nextn" in takes and mtp_agreement is not None and n_nextn is None:
        own["n_nextn"] = 1  # an agreeing MTP block needs a block
    for key, value in own.items():
        if value is not None and key not in takes:
            where = " or ".join(taking(key))
            raise UserError(f"{key} {'apply' if key == 'options' else 'applies'} only to --arch {where}")
    own_options = own.pop("options") or {}
    p = resolve(preset, layers, dict(
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_expert=n_expert,
        n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, context_length=context_length),
        presets).refine(layers, {k: v for k, v in own.items() if v is not None}, own_options)
    if expert_qtype is None:
        expert_qtype = p.expert_qtype
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise UserError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    requantize = p.Q4_K_M_KEEPS_Q4_K and qtype == "q4_k_m" and expert_qtype == "q4_k"
    if preset.startswith("geometry-") and qtype == "q4_k_m" and expert_qtype == "q4_k" and not requantize:
        raise UserError(f"{preset} writes its experts as Q4_K directly; use --type f32, f16 or "
                        "q8_0 for its dense tensors (q4_k_m would requantise the experts)")
    validate_common(p, qtype, None if requantize else expert_qtype)
    p.validate(qtype, expert_qtype)

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
        tied = p.default_tied(n_vocab)
    plans = p.plan(n_vocab, qtype, expert_qtype, bool(tied), router_near_tie)
    if mtp_agreement is not None:
        if not p.mtp_blocks():
            writes = ", ".join(a for a, ps in PRESETS_BY_ARCH.items() if next(iter(ps.values())).MTP)
            raise UserError(f"--mtp-agreement needs an architecture whose MTP block make-model writes "
                            f"({writes}), not {arch}")
        if not 0.0 <= mtp_agreement <= 1.0:
            raise UserError(f"--mtp-agreement must be between 0 and 1, got {mtp_agreement}")
        plans = agreeing_mtp(plans, mtp_agreement)

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
        _write_gguf(write_to, p, plans, tok_kv, preset=preset, seed=seed, qtype=qtype,
                    expert_qtype=expert_qtype, tied=bool(tied), router_near_tie=router_near_tie,
                    progress=progress, arch=arch)
        if qtype == "q4_k_m":
            if progress is not None:
                progress(0, 1, "quantising to Q4_K_M with llama.cpp")
            _quantize_q4_k_m(tmp_f32, tmp, requantize)
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

    arch = val("general.architecture") or DEFAULT_ARCH  # the key prefix

    n_expert = int(val(f"{arch}.expert_count") or 0)
    per_expert = 0
    types: set[str] = set()
    # the first layer with routed experts (glm4moe's and deepseek2's first layers are dense)
    first = min((int(t.name.split(".")[1]) for t in tis if t.name.startswith("blk.") and "_exps." in t.name),
                default=0)
    for t in tis:
        if t.name.startswith(f"blk.{first}.") and "_exps." in t.name and n_expert:
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
