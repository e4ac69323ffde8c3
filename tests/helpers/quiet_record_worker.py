"""``p2pswarm node --role worker`` whose DHT record is published once and never again (tests only).

Usage: ``python tests/helpers/quiet_record_worker.py node --role worker ...`` (the real command's
arguments). Its record then expires in the DHT after ``--ttl`` seconds while the worker keeps
serving on every connection it has: what a backbone sees when a worker's re-published records do
not reach it (a worker behind a NAT whose only way out is a relay, under load). Every later
re-publication is counted and dropped here, in the test's wrapper: the production command has no
switch for it. Everything else is the real command, in a real process, over real sockets.
"""
from __future__ import annotations

import logging
import sys

from p2pswarm import cli
from p2pswarm.net.advertiser import ShardAdvertiser

_publish = ShardAdvertiser.publish_record


async def publish_once(self: ShardAdvertiser) -> bool:
    """The first record goes out; later ones are counted (``rounds``) and dropped."""
    if self.rounds == 0:
        return await _publish(self)
    self.rounds += 1
    logging.getLogger("p2pswarm.net").info("record re-publication %d dropped (quiet_record_worker)", self.rounds)
    return True


if __name__ == "__main__":
    ShardAdvertiser.publish_record = publish_once  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
