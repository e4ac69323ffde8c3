"""`p2pswarm slice MODEL.gguf --layers A-B --experts C-D -o shard.gguf` / `--backbone -o backbone.gguf`."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from p2pswarm.errors import UserError
from p2pswarm.model.slicer import parse_range, slice_backbone, slice_experts
from p2pswarm.progress import ProgressBar

if TYPE_CHECKING:
    from p2pswarm.model.manifest import ModelManifest


def add_parser(sub) -> None:
    p = sub.add_parser("slice", help="cut an expert shard (or the backbone) out of a MoE GGUF by byte-range copy")
    p.add_argument("model", help="source MoE GGUF")
    p.add_argument("--layers", help="layer range A-B, inclusive (default: all)")
    p.add_argument("--experts", help="expert range C-D, inclusive")
    p.add_argument("--backbone", action="store_true", help="write everything except the routed experts")
    p.add_argument("-o", "--output", required=True, help="output GGUF")
    p.add_argument("--manifest", metavar="FILE",
                   help="the model's signed manifest (`p2pswarm manifest`): also write OUT.source beside an expert "
                        "shard, so a worker serving it with --shard serves its slabs onwards to peers (a backbone's "
                        "expert cache)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output (the result line stays)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.backbone and (args.experts or args.layers):
        raise UserError("--backbone takes no --layers/--experts: it keeps every layer's dense part")
    if not args.backbone and not args.experts:
        raise UserError("give --experts C-D (or --backbone)")
    if args.manifest and args.backbone:
        raise UserError("--manifest is for an expert shard (a worker serves its slabs onwards)")
    # (manifest, the model's header bytes), checked before anything is written: no shard without its sidecar
    source = _source_of(args.model, args.manifest) if args.manifest else None
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
    if source is not None:
        from p2pswarm.net.shards.server import _write_source_sidecar

        print(f"wrote {_write_source_sidecar(Path(args.output), *source)}")
    return 0


def _source_of(model: str, manifest_path: str) -> tuple[ModelManifest, bytes]:
    """(manifest, the model's header bytes) for a shard's ``.source`` sidecar; a one-line error
    when the manifest is not this model's. (Its signature is checked by whoever uses it: the
    worker, against its --trust-issuer.)"""
    import hashlib

    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint, read_manifest

    manifest = read_manifest(manifest_path)
    layout = ModelLayout.open(model)
    header = layout.header_bytes()
    if (manifest.fingerprint != model_fingerprint(layout)
            or hashlib.sha256(header).hexdigest() != manifest.header_sha256):
        raise UserError(f"--manifest {manifest_path}: the manifest is for model {manifest.fingerprint[:12]}, "
                        f"not {model}")
    return manifest, header
