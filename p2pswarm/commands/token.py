"""`p2pswarm token issue|show`: make and read node tokens (see p2pswarm/net/signed/tokens.py).

The issuer key must already exist: a token signed by a key nobody trusts yet is useless, and a
typo in ``--key`` silently minting a fresh issuer would hide that. ``--create-key`` makes one
(mode 0600) on purpose; its peer id is what services are then told to trust (``--trust-issuer``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from p2pswarm.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("token", help="issue or inspect node tokens (signed capabilities)")
    tsub = p.add_subparsers(dest="token_command", metavar="issue|show")
    tsub.required = True
    i = tsub.add_parser("issue", help="sign a token for a peer")
    i.add_argument("--key", required=True, metavar="ISSUER.key", help="the issuer's Ed25519 identity key")
    i.add_argument("--create-key", action="store_true", help="create the issuer key (mode 0600) if it is missing")
    i.add_argument("--peer", required=True, metavar="PEER_ID", help="the holder's peer id "
                   "(`p2pswarm identity --path KEY` prints it)")
    i.add_argument("--allow", action="append", required=True, metavar="SCOPE",
                   help="relay | shard | shard:MODEL | shard:MODEL:A-B:C-D (MODEL a fingerprint or *; repeatable)")
    i.add_argument("--ttl", default="7d", help="lifetime: N with unit s, m, h or d (default 7d)")
    i.add_argument("--out", metavar="FILE", help="write the token to FILE (mode 0600) instead of stdout")
    i.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    i.set_defaults(func=run_issue)
    s = tsub.add_parser("show", help="decode a token and check its signature")
    s.add_argument("token", metavar="TOKEN_OR_FILE", help="the token, or a file holding it")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.set_defaults(func=run_show)


def run_issue(args) -> int:
    from p2pswarm.net.signed.identity import load_identity, load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token, parse_ttl

    ttl = parse_ttl(args.ttl)
    key = Path(args.key)
    if not key.exists() and not key.is_symlink() and not args.create_key:
        raise UserError(f"issuer key {key} does not exist (pass --create-key to make a new issuer)")
    issuer = load_or_create_identity(key) if args.create_key else load_identity(key)
    tok = issue_token(issuer, args.peer, args.allow, ttl)
    text = tok.encode()
    if args.out:
        out = Path(args.out)
        if out.exists() and not args.force:
            raise UserError(f"{out} exists (pass --force to overwrite it)")
        if not out.parent.exists():
            raise UserError(f"{out.parent}: directory does not exist")
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, (text + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, out)
        print(f"wrote {out}: token for {tok.holder} allowing {', '.join(tok.allow)}, "
              f"issued by {tok.issuer}, expires {tok.describe()['expires_at']}", file=sys.stderr)
    else:
        print(text)
    return 0


def run_show(args) -> int:
    from p2pswarm.net.signed.tokens import NodeToken, load_token

    tok = NodeToken.decode(load_token(args.token))
    d = tok.describe()
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"issuer:    {d['issuer']}")
    print(f"holder:    {d['holder']}")
    print(f"allow:     {', '.join(d['allow'])}")
    print(f"issued:    {d['issued_at']}")
    print(f"expires:   {d['expires_at']} ({'expired ' if d['expired'] else ''}{d['expires_in']})")
    print(f"signature: {'verifies' if d['signature_ok'] else 'DOES NOT VERIFY'}")
    return 0


run = run_show
