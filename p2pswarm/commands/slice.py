"""`p2pswarm slice MODEL.gguf --layers A-B --experts C-D -o shard.gguf` / `--backbone -o backbone.gguf`."""
from __future__ import annotations

import contextlib

from p2pswarm.errors import UserError
from p2pswarm.model.slicer import parse_range, slice_backbone, slice_experts
from p2pswarm.progress import ProgressBar


def add_parser(sub) -> None:
    p = sub.add_parser("slice", help="cut an expert shard (or the backbone) out of a MoE GGUF by byte-range copy")
    p.add_argument("model", help="source MoE GGUF")
    p.add_argument("--layers", help="layer range A-B, inclusive (default: all)")
    p.add_argument("--experts", help="expert range C-D, inclusive")
    p.add_argument("--backbone", action="store_true", help="write everything except the routed experts")
    p.add_argument("-o", "--output", required=True, help="output GGUF")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output (the result line stays)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.backbone and (args.experts or args.layers):
        raise UserError("--backbone takes no --layers/--experts: it keeps every layer's dense part")
    if not args.backbone and not args.experts:
        raise UserError("give --experts C-D (or --backbone)")
    with contextlib.nullcontext(None) if args.quiet else ProgressBar("slice", unit="B") as bar:
        progress = bar.update if bar is not None else None
        if args.backbone:
            res = slice_backbone(args.model, args.output, progress=progress)
        else:
            layers = parse_range(args.layers, "layer") if args.layers else None
            res = slice_experts(args.model, args.output, layers, parse_range(args.experts, "expert"),
                                progress=progress)
    print(f"wrote {res.path}: {len(res.tensors)} tensors, {res.nbytes / 1e6:.1f} MB of tensor data "
          f"(model {res.source_fingerprint})")
    return 0
