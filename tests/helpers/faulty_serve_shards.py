"""``p2pswarm serve-shards`` with faults injected, for the download tests.

Usage: ``python tests/helpers/faulty_serve_shards.py [--delay-s S] [--corrupt-chunks 3,7] serve-shards ...``

Why a wrapper and not environment variables in the command: fault injection is test code; the
production command has no hooks to misconfigure. ``--delay-s`` sleeps before each chunk (widens
the window for a kill); ``--corrupt-chunks`` flips a byte of those chunks (1-based, in serving
order). Everything else is the real command, in a real process, over real sockets.
"""
from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from p2pswarm import cli
from p2pswarm.commands import serve_shards


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="faulty_serve_shards")
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--corrupt-chunks", default="")
    ours, rest = ap.parse_known_args(argv)
    faults = {"delay_s": ours.delay_s,
              "corrupt_chunks": {int(x) for x in ours.corrupt_chunks.split(",") if x}}
    logging.getLogger("p2pswarm.serve_shards").warning("fault injection: %s", faults)
    serve_shards.run = partial(serve_shards.run, **faults)  # what build_parser binds as the command
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
