"""`p2pswarm manifest --model M.gguf --key ISSUER.key --out M.manifest`: hash and sign a model.

The manifest is what downloaders (`p2pswarm fetch`, `node --role worker` without a local shard)
check every byte against; shard servers hand it out. Hashing every byte is the costly part
(minutes for a 77 GB model); tensors are hashed in parallel threads (``--threads``).
"""
from __future__ import annotations

from pathlib import Path

from p2pswarm.commands.common import positive_int
from p2pswarm.errors import UserError
from p2pswarm.progress import ProgressBar


def add_parser(sub) -> None:
    p = sub.add_parser("manifest", help="hash every tensor (and expert slab) of a model and sign the manifest")
    p.add_argument("--model", required=True, help="the full model GGUF")
    p.add_argument("--key", required=True, metavar="ISSUER.key", help="the issuer's Ed25519 identity key "
                   "(downloaders trust its peer id with --trust-issuer)")
    p.add_argument("--out", required=True, metavar="M.manifest",
                   help="the signed manifest to write (shard servers hand it to downloaders)")
    p.add_argument("--threads", type=positive_int, default=2, help="hashing threads (default 2)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.set_defaults(func=run)


def run(args) -> int:
    from p2pswarm.model.manifest import build_manifest, write_manifest
    from p2pswarm.net.signed.identity import load_identity

    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"{out} exists (pass --force to overwrite it)")
    if out.exists() and out.resolve() == Path(args.model).resolve():
        raise UserError(f"{out}: refusing to overwrite the model")
    issuer = load_identity(args.key)
    bar = ProgressBar("manifest", unit="B")
    try:
        m = build_manifest(args.model, issuer, progress=bar.update, threads=args.threads)
    finally:
        bar.close()
    write_manifest(m, out)
    n_slabs = sum(t.n_expert for t in m.tensors)
    print(f"wrote {out}: model {m.fingerprint}, {len(m.tensors)} tensors, {n_slabs} expert slabs, "
          f"signed by {m.issuer}")
    return 0
