"""`p2pswarm identity [--path KEY | --name NAME]`: print a node's peer id, creating its key if needed.

An operator issuing a token needs the holder's peer id before the holder ever starts; this makes
(or reads) the key file the node will use and prints the id. ``node --role worker`` uses
``$P2PSWARM_HOME/identity/worker.key`` unless given ``--identity``.
"""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("identity", help="print a node's peer id (creating its key file, mode 0600, if missing)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--path", metavar="KEY", help="identity key file")
    g.add_argument("--name", default="node", help="key $P2PSWARM_HOME/identity/NAME.key (default node; "
                                                  "`node --role worker` uses worker)")
    p.add_argument("--no-create", action="store_true", help="fail instead of creating a missing key")
    p.set_defaults(func=run)


def run(args) -> int:
    from p2pswarm.net.signed.identity import (
        default_identity_path,
        load_identity,
        load_or_create_identity,
    )

    path = args.path or default_identity_path(args.name)
    ident = load_identity(path) if args.no_create else load_or_create_identity(path)
    print(ident.peer_id_str)
    return 0
