"""``p2pswarm make-model``: write a seeded random-weight MoE GGUF of any architecture p2pswarm serves (see
p2pswarm.model.synth)."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from p2pswarm.commands.common import positive_int
from p2pswarm.errors import UserError
from p2pswarm.progress import ProgressBar


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from p2pswarm.model.synth_arches import ARCHES, DEFAULT_ARCH, PRESETS_BY_ARCH, taking
    from p2pswarm.model.synth_presets import QTYPES

    def first(arch: str):
        return next(iter(PRESETS_BY_ARCH[arch].values()))

    def arch_text(arch: str) -> str:
        notes = [n for n in ("default" if arch == DEFAULT_ARCH else "", first(arch).DESCRIPTION) if n]
        return arch + (f" ({'; '.join(notes)})" if notes else "")

    def only(keyword: str) -> str:
        return " and ".join(taking(keyword))

    mtp = [a for a in ARCHES if first(a).MTP]

    def presets_text(arch: str) -> str:
        return "; ".join(
            f"{name}: {pr.n_layer} layers, n_embd {pr.n_embd}, {pr.n_expert} experts "
            f"(top-{pr.n_expert_used}), n_ff_exp {pr.n_ff_exp}"
            + (f", {pr.expert_qtype.upper()} experts" if pr.expert_qtype else "")
            for name, pr in PRESETS_BY_ARCH[arch].items())

    preset_names = sorted({name for presets in PRESETS_BY_ARCH.values() for name in presets})
    p = subparsers.add_parser(
        "make-model",
        help=f"write a seeded random-weight {', '.join(ARCHES)} GGUF (tests, demo, benchmarks)",
        description=(
            "Write a seeded random-weight MoE GGUF that llama.cpp loads and runs. The same "
            "options and seed always give the same bytes. "
            + " ".join(f"{arch} presets: {presets_text(arch)}." for arch in ARCHES)
        ),
    )
    p.add_argument("-o", "--output", required=True, metavar="M.gguf", help="file to write")
    p.add_argument("--arch", choices=list(ARCHES), default=DEFAULT_ARCH,
                   help="architecture: " + ", ".join(map(arch_text, ARCHES)))
    p.add_argument("--preset", choices=preset_names, default="tiny", help="model shape (default: tiny)")
    p.add_argument("--layers", type=positive_int, metavar="N",
                   help="number of layers (default: the preset's)")
    p.add_argument("--type", dest="qtype", choices=list(QTYPES), default="f32",
                   help="tensor type: f32 (default), f16, q8_0 (norms and router stay F32), "
                        "q4_k_m (llama.cpp's quantiser; needs p2pswarm[llama]). A preset with its own "
                        "expert type (Q4_K or MXFP4 experts, above) keeps it whatever this says")
    p.add_argument("--vocab", metavar="FILE.gguf|qwen35",
                   help="copy the tokenizer.ggml.* vocabulary of this GGUF; 'qwen35': the real Qwen3.5 "
                        "vocabulary shipped with p2pswarm (p2pswarm/data/ggml-vocab-qwen35.gguf); default: a "
                        "small built-in byte-level BPE")
    p.add_argument("--seed", type=_seed, default=0, metavar="N",
                   help="random seed: the same seed and options give the same bytes (default: 0)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None,
                     help="no output.weight: the lm head reuses token_embd")
    tie.add_argument("--untied", dest="tied", action="store_false", default=None,
                     help="write a separate output.weight (default unless the vocabulary has "
                          "more than 32,768 tokens)")
    p.add_argument("--router-near-tie", action="store_true",
                   help="router weights 100x smaller: top-k margins small but never zero")
    p.add_argument("--expert-type", dest="expert_qtype", choices=["q4_k", "mxfp4"], default=None,
                   help="write the routed experts directly as random Q4_K or MXFP4 blocks (the presets "
                        "with their own expert type, above, always do)")
    q35 = p.add_argument_group(f"{only('fused_experts')} only")
    q35.add_argument("--fused-experts", action="store_true", default=None,
                     help="store each layer's expert gate and up as one ffn_gate_up_exps tensor "
                          "(gate rows first), as some converters do; same weights as unfused")
    q35.add_argument("--rope-sections", type=_sections, metavar="T,H,W,E",
                     help="the 4 IMROPE sections (default: the preset's, covering every rotary pair)")
    q35.add_argument("--n-rot", type=positive_int, metavar="N",
                     help="rotated dims per attention head (default: the preset's, head_dim/4)")
    q35.add_argument("--ssm-group-count", type=positive_int, metavar="HK",
                     help="DeltaNet q/k heads (Hk)")
    q35.add_argument("--ssm-time-step-rank", type=positive_int, metavar="HV",
                     help="DeltaNet v heads (Hv, a multiple of Hk)")
    q35.add_argument("--ssm-state-size", type=positive_int, metavar="D", help="DeltaNet head size")
    q35.add_argument("--full-attention-interval", type=positive_int, metavar="N",
                     help="every N-th layer is full attention, the others DeltaNet (default 4)")
    always = [a for a in mtp if a not in taking("n_nextn")]
    glm = p.add_argument_group(f"MTP (NextN) blocks: {', '.join(mtp)}")
    glm.add_argument("--mtp-blocks", type=int, metavar="N", default=None,
                     help=f"{only('n_nextn')}: MTP (NextN) blocks after the trunk, as the real models' files "
                          f"carry (0 or 1; default 0, 1 with --mtp-agreement)"
                          + "".join(f"; {a}'s presets always write one" for a in always))
    glm.add_argument("--mtp-agreement", type=float, metavar="A", default=None,
                     help="0..1: write a model whose MTP (NextN) block agrees with the trunk (1: nearly always), "
                          "to measure speculative decoding's acceptance on random weights")
    oss = p.add_argument_group(f"{only('sliding_window')} only")
    oss.add_argument("--sliding-window", type=positive_int, metavar="N",
                     help="positions a sliding-window layer sees (every even layer; default: the preset's)")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="write a split model, as llama.cpp's gguf-split does: parts of at most SIZE of "
                        "tensor data (e.g. 200M, 2G) named M-00001-of-0000N.gguf for -o M.gguf; "
                        "every command then takes the first part as the model")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)
    return p


def _vocab(name: str | None):
    """``--vocab qwen35`` names the shipped vocabulary; anything else is a file path."""
    if name == "qwen35":
        from p2pswarm.model.vocab import qwen35_vocab_path

        return qwen35_vocab_path()
    return name


def _sections(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 4 comma-separated integers, got {text!r}") from None
    if len(v) != 4 or min(v) < 0 or sum(v) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected 4 non-negative comma-separated integers with a positive sum, got {text!r}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v < 2**64:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {v}")
    return v


def run(args: argparse.Namespace) -> int:
    from p2pswarm.model import synth
    from p2pswarm.model.split_write import parse_size, split_prefix_of, write_split

    if args.layers is not None and args.layers > 512:
        raise UserError(f"--layers must be at most 512, got {args.layers}")
    split_bytes = parse_size(args.split_max_size) if getattr(args, "split_max_size", None) else None
    progress = None if getattr(args, "quiet", False) else ProgressBar("make-model", unit="B")
    t0 = time.monotonic()
    # a split model is written whole to a hidden name first, then cut into its parts
    out = Path(args.output)
    target = out.with_name(f".{out.name}.unsplit-{os.getpid()}.gguf") if split_bytes else out
    try:
        path = synth.make_model(
            target,
            preset=args.preset,
            layers=args.layers,
            qtype=args.qtype,
            vocab=_vocab(args.vocab),
            seed=args.seed,
            tied=args.tied,
            router_near_tie=args.router_near_tie,
            expert_qtype=args.expert_qtype,
            mtp_agreement=args.mtp_agreement,
            progress=progress,
            **_arch_options(args),
        )
        info = synth.describe(path)
        if split_bytes:
            parts = write_split(path, split_prefix_of(out), split_bytes, progress=progress)
            path = parts[0]
    finally:
        if split_bytes:
            target.unlink(missing_ok=True)
        if progress is not None:
            progress.close()
    print(
        f"wrote {path}: {info['architecture']} {info['preset']}, {info['n_layer']} layers, n_embd "
        f"{info['n_embd']}, {info['n_expert']} experts (top-{info['n_expert_used']}) of "
        f"n_ff_exp {info['n_ff_exp']}, n_vocab {info['n_vocab']}"
        f"{', tied' if info['tied'] else ''}{', fused' if info['fused_experts'] else ''}, experts "
        f"{'/'.join(info['expert_types'])} "
        f"({info['bytes_per_expert']:,} bytes per expert), {info['file_bytes']:,} bytes, "
        f"seed {info['seed']}, {time.monotonic() - t0:.1f} s"
        + (f"; in {len(parts)} parts (name the first: {path})" if split_bytes else "")
    )
    return 0


def _arch_options(args: argparse.Namespace) -> dict:
    """The architecture-only options the user gave (make_model refuses those the architecture
    does not take, one line)."""
    from p2pswarm.model.synth_arches import DEFAULT_ARCH

    arch = getattr(args, "arch", DEFAULT_ARCH)
    opts = {
        "fused_experts": getattr(args, "fused_experts", None),
        "rope_sections": getattr(args, "rope_sections", None),
        "n_rot": getattr(args, "n_rot", None),
        "ssm_group_count": getattr(args, "ssm_group_count", None),
        "ssm_time_step_rank": getattr(args, "ssm_time_step_rank", None),
        "ssm_state_size": getattr(args, "ssm_state_size", None),
        "full_attention_interval": getattr(args, "full_attention_interval", None),
        "n_nextn": getattr(args, "mtp_blocks", None),
        "sliding_window": getattr(args, "sliding_window", None),
    }
    opts = {k: v for k, v in opts.items() if v is not None}
    if arch == DEFAULT_ARCH and not opts:
        return {}  # the exact call the default architecture always made
    return {"arch": arch, **opts}
