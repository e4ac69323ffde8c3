"""The provider side of the swarm DHT: a worker's signed node record and its provider records
(:class:`ShardAdvertiser`). Keys and record formats: :mod:`p2pswarm.net.signed.records`, docs/protocol.md."""
from __future__ import annotations

import logging
import math
import random
import time
from typing import Sequence

import trio

from p2pswarm.errors import SwarmError, UserError
from p2pswarm.net.libp2p.addrs import error_reason
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.dht.kademlia import REPROVIDE_S, SwarmDHT
from p2pswarm.net.signed.records import (DEFAULT_RECORD_TTL_S, NodeRecord, RecordError, ShardEntry, model_key,
                                  node_record_key, units_for)

log = logging.getLogger("p2pswarm.net")


class ShardAdvertiser:
    """Publishes this node's signed record and provides every coverage unit of its shards (and its
    model's :func:`~p2pswarm.net.signed.records.model_key`); re-publishes the record every ``refresh_s``
    (a third of its TTL) and the provider records every ``reprovide_s``; withdraws on clean shutdown.

    Two cadences because they do different jobs. The record is the liveness signal: short-lived
    (default 60 s) so a killed worker drops out of every look-up within one TTL, and cheap to
    refresh (one look-up and 20 stores, whatever the shard's size). Provider records only say "ask
    this peer's record" and py-libp2p keeps them 48 h, so they are re-sent rarely (default 5 min;
    a phone with 400 units would otherwise send 8,000 ADD_PROVIDERs every 20 s). Re-providing also
    re-announces the units to whichever peers are closest *now*, so DHT nodes that joined since the
    last round learn about us."""

    def __init__(self, dht: SwarmDHT, identity: Identity, *, shards: Sequence[ShardEntry], protocol: int,
                 kernel: str, block_size: int, ttl_s: float = DEFAULT_RECORD_TTL_S, refresh_s: float | None = None,
                 reprovide_s: float | None = None, concurrency: int = 8):
        if ttl_s < 3:
            raise UserError("record TTL must be at least 3 s")
        self.dht = dht
        self.identity = identity
        self.shards = tuple(shards)
        self.protocol = protocol
        self.kernel = kernel
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s or ttl_s / 3
        if self.refresh_s >= ttl_s:
            raise UserError("record refresh interval must be shorter than the record TTL")
        self.reprovide_s = reprovide_s or max(self.refresh_s, REPROVIDE_S)
        self.concurrency = concurrency
        self.units = sorted({u for s in shards for u in units_for(s.model, s.layers, s.experts, block_size)})
        self.model_keys = sorted({model_key(s.model) for s in shards})
        self.record: NodeRecord | None = None
        self.rounds = 0  # records published
        self.provide_rounds = 0  # rounds of provider records sent
        self._provided_at = -math.inf

    async def set_shards(self, shards: Sequence[ShardEntry]) -> int:
        """Serve ``shards`` from now on (``node --auto`` re-enrolling): units no longer held are no
        longer provided, and a new record (higher seq) plus provider records of the new units go
        out at once. Returns how many units reached the DHT."""
        self.shards = tuple(shards)
        units = sorted({u for s in self.shards for u in units_for(s.model, s.layers, s.experts, self.block_size)})
        for u in set(self.units) - set(units):
            self.dht.stop_providing(u.key())
        self.units = units
        self.model_keys = sorted({model_key(s.model) for s in self.shards})
        return await self.publish()

    def _record(self, withdrawn: bool = False) -> NodeRecord:
        addrs = self.dht.net.addrs()
        if not addrs and not withdrawn:
            raise UserError("nothing to advertise: listening on a wildcard address only; give an announce address")
        seq = None
        if self.record is not None:
            seq = max(int(time.time() * 1000), self.record.seq + 1)
        return NodeRecord.make(self.identity, addrs=addrs, protocol=self.protocol, kernel=self.kernel,
                               block_size=self.block_size, shards=self.shards, ttl_s=self.ttl_s,
                               withdrawn=withdrawn, seq=seq)

    async def publish_record(self) -> bool:
        """Put a fresh record (new expiry) at the closest peers; False when no peer took it."""
        self.record = self._record()
        self.rounds += 1
        try:
            return await self.dht.put_value(node_record_key(self.identity.peer_id_str), self.record.signed) > 0
        except (Exception, trio.TooSlowError) as exc:
            log.warning("publishing our node record failed: %s", error_reason(exc))
            return False

    async def publish(self) -> int:
        """Put our record, then provide every unit and the model key. Returns how many units
        reached a peer."""
        await self.publish_record()
        # The model key first: it is the index a backbone resolves the whole map from
        # (coverage.py), so it must not queue behind a hundred unit provides and time out in a busy
        # DHT (measured: 2 of 16 workers missing from the index when it went last). Once more if
        # no peer took it.
        for k in self.model_keys:
            if not await self.dht.provide(k):
                await self.dht.provide(k)
        ok = 0
        limiter = trio.CapacityLimiter(self.concurrency)

        async def one(key: bytes) -> None:
            nonlocal ok
            async with limiter:
                if await self.dht.provide(key):
                    ok += 1

        async with trio.open_nursery() as nursery:
            for u in self.units:
                nursery.start_soon(one, u.key())
        self.provide_rounds += 1
        self._provided_at = time.monotonic()
        return ok

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Publish now (``task_status.started(units provided)``), then the record every
        ``refresh_s`` and the provider records every ``reprovide_s``."""
        ok = await self.publish()
        log.info("providing %d units (%d reached the DHT) for %s; record refreshed every %.0f s (TTL %.0f s)",
                 len(self.units), ok, "; ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} experts "
                                                f"{s.experts[0]}-{s.experts[1] - 1}" for s in self.shards),
                 self.refresh_s, self.ttl_s)
        task_status.started(ok)
        while True:
            await trio.sleep(self.refresh_s * random.uniform(0.9, 1.0))
            try:
                if time.monotonic() - self._provided_at >= self.reprovide_s * 0.95:
                    ok = await self.publish()
                    if ok < len(self.units):
                        log.warning("re-provide: only %d of %d units reached the DHT", ok, len(self.units))
                elif not await self.publish_record():
                    log.warning("record refresh reached no DHT peer; retrying in %.0f s", self.refresh_s)
            except (SwarmError, RecordError) as exc:  # e.g. our listeners are gone: try again later
                log.warning("re-provide failed: %s", exc)

    async def withdraw(self, *, timeout_s: float = 10.0) -> bool:
        """Publish a withdrawn record (shielded, bounded: callable from a cancelled scope)."""
        for key in [u.key() for u in self.units] + self.model_keys:
            self.dht.stop_providing(key)
        with trio.CancelScope(shield=True), trio.move_on_after(timeout_s):
            try:
                self.record = self._record(withdrawn=True)
                await self.dht.put_value(node_record_key(self.identity.peer_id_str), self.record.signed)
                log.info("withdrew %d units from the DHT", len(self.units))
                return True
            except (Exception, trio.TooSlowError) as exc:
                log.warning("withdrawing our record failed: %s", error_reason(exc))
        return False


