"""``p2pswarm node --role worker`` whose DHT record stops being re-published on cue (tests only).

Usage: ``python tests/helpers/quiet_record_worker.py --quiet-when PATH node --role worker ...`` (the
real command's arguments after ours). Records go out as usual until the file ``PATH`` exists; from
then on every re-publication is counted and dropped, so the last record expires in the DHT after
``--ttl`` seconds while the worker keeps serving on every connection it has: what a backbone sees
when a worker's re-published records do not reach it (a worker behind a NAT whose only way out is
a relay, under load). The cue lets a test go quiet only once the backbone uses the worker (a
record that expired before the backbone's first look-up would never be found at all). The
dropping is done here, in the test's wrapper: the production command has no switch for it.
Everything else is the real command, in a real process, over real sockets.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from p2pswarm import cli
from p2pswarm.net.dht.advertiser import ShardAdvertiser


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="quiet_record_worker")
    ap.add_argument("--quiet-when", type=Path, required=True)
    ours, rest = ap.parse_known_args(argv)
    publish = ShardAdvertiser.publish_record

    async def quiet_on_cue(self: ShardAdvertiser) -> bool:
        if not ours.quiet_when.exists():
            return await publish(self)
        self.rounds += 1
        logging.getLogger("p2pswarm.net").info("record re-publication %d dropped (quiet_record_worker)", self.rounds)
        return True

    ShardAdvertiser.publish_record = quiet_on_cue  # type: ignore[method-assign]
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
