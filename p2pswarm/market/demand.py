"""Demand records: what a backbone's router asks for, signed and expiring, in the DHT.

Each backbone publishes one record for the model it serves, under ``/p2pswarm/demand/<peer id>``
(a DHT value, like node records), re-published every ``period_s`` with a higher sequence number,
and *provides* :data:`MARKET_KEY`, the one well-known key through which a worker started with
``--auto`` and no model finds every backbone's record. The record carries, per coverage unit
(layer-major, block-minor), the backbone's decayed routing count
(:class:`p2pswarm.backbone.dispatch.dispatcher.DemandCounter`: rows routed to the unit's experts, half-life
60 s), and the geometry a worker needs to enrol without downloading anything first: the model
fingerprint, its expert layers, experts per layer, block size, and bytes of one unit per layer.

Wire format (msgpack): ``{"body": bin, "sig": bin}``; ``sig`` is Ed25519 by the backbone's peer key
over ``b"p2pswarm-demand-record-v1\\0" + body``; ``body`` a map, see docs/protocol.md. The demand
vector is float32 little-endian bytes: 49 layers x 32 blocks is 6 KB, under :data:`MAX_DEMAND_BYTES`
(64 KB), so one record per model suffices for the 122B.

Trust: demand is advisory. A forged or inflated record can only move where workers enrol; what
they download is checked against the manifest of a ``--trust-issuer`` and what they compute is the
same function whoever asks. Validation (:func:`DemandRecord.verify`, and the DHT-side
:class:`DemandValidator`) still rejects forged, malformed, oversized, expired and future records,
and a worker sums the demand of distinct backbones (one record each: the newest sequence number).
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from p2pswarm.errors import UserError
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import newest_index, open_signed

log = logging.getLogger("p2pswarm.market")

DEMAND_VERSION = 1
DEMAND_PREFIX = "/p2pswarm/demand/"
SIGNING_DOMAIN = b"p2pswarm-demand-record-v1\x00"
MARKET_KEY = b"\x12\x20" + hashlib.sha256(b"p2pswarm-market-v1\x00").digest()  # provided by every backbone
MAX_DEMAND_BYTES = 64 << 10
MAX_UNITS = 1 << 14
MAX_ADDRS = 16
MAX_TTL_S = 24 * 3600
CLOCK_SKEW_S = 300
DEFAULT_DEMAND_TTL_S = 120.0
DEFAULT_DEMAND_PERIOD_S = 40.0


class DemandError(UserError):
    """A demand record that is malformed, forged, expired or oversized (one line)."""


def demand_key(peer) -> str:
    return DEMAND_PREFIX + (peer.to_base58() if hasattr(peer, "to_base58") else str(peer))


def peer_of_demand_key(key: str) -> str | None:
    return key[len(DEMAND_PREFIX):] if key.startswith(DEMAND_PREFIX) else None


@dataclass(frozen=True)
class DemandRecord:
    """One backbone's demand for one model's units."""

    peer: str
    model: str
    layers: tuple[int, ...]
    n_expert: int
    block_size: int
    unit_bytes: tuple[int, ...]  # per layer: bytes of a full unit (block_size experts)
    demand: tuple[float, ...]  # per unit, layer-major
    seq: int
    issued: int
    expires: int
    addrs: tuple[str, ...] = ()  # where to dial the backbone (no /p2p/)
    serves_shards: bool = False  # it serves /p2pswarm/shard/1.0.0 downloads to token holders
    signed: bytes = field(default=b"", compare=False, repr=False)
    #: per unit (layer-major): True where the backbone does not hold every expert of the unit in its
    #: expert cache (--expert-cache), so it needs a worker's replica; empty: it holds them all (a
    #: record without the field, as before the cache)
    lacks: tuple[bool, ...] = ()

    def shard_source(self):
        """A PeerInfo to download slices from, when this backbone serves them (else None)."""
        if not self.serves_shards or not self.addrs:
            return None
        import multiaddr
        from libp2p.peer.id import ID
        from libp2p.peer.peerinfo import PeerInfo

        return PeerInfo(ID.from_base58(self.peer), [multiaddr.Multiaddr(a) for a in self.addrs])

    @property
    def n_blocks(self) -> int:
        return math.ceil(self.n_expert / self.block_size)

    def unit_index(self, layer: int, block: int) -> int:
        return self.layers.index(layer) * self.n_blocks + block

    def unit_size(self, layer: int, block: int) -> int:
        """Bytes of unit (layer, block): the last block of a layer may hold fewer experts."""
        experts = min(self.block_size, self.n_expert - block * self.block_size)
        return self.unit_bytes[self.layers.index(layer)] * experts // self.block_size

    def live(self, now: float | None = None) -> bool:
        return self.expires >= (time.time() if now is None else now)

    @classmethod
    def make(cls, identity: Identity, *, model: str, layers, n_expert: int, block_size: int, unit_bytes,
             demand, ttl_s: float = DEFAULT_DEMAND_TTL_S, seq: int | None = None, addrs=(),
             serves_shards: bool = False, now: float | None = None, lacks=()) -> "DemandRecord":
        now = time.time() if now is None else now
        rec = cls(identity.peer_id_str, model, tuple(int(x) for x in layers), int(n_expert), int(block_size),
                  tuple(int(x) for x in unit_bytes), tuple(float(x) for x in demand),
                  int(now * 1000) if seq is None else seq, int(now), int(now + ttl_s), tuple(addrs)[:MAX_ADDRS],
                  bool(serves_shards), lacks=tuple(bool(x) for x in lacks))
        return rec.sign(identity)

    def body(self) -> dict:
        return {"v": DEMAND_VERSION, "peer": self.peer, "model": self.model, "layers": list(self.layers),
                "n_expert": self.n_expert, "block_size": self.block_size, "unit_bytes": list(self.unit_bytes),
                "demand": np.asarray(self.demand, dtype="<f4").tobytes(), "seq": self.seq, "issued": self.issued,
                "expires": self.expires, "addrs": list(self.addrs), "serves_shards": self.serves_shards,
                **({"lacks": bytes(int(x) for x in self.lacks)} if self.lacks else {})}

    def sign(self, identity: Identity) -> "DemandRecord":
        if identity.peer_id_str != self.peer:
            raise DemandError("a demand record can only be signed by the backbone it names")
        self._check_shape()
        body = msgpack.packb(self.body(), use_bin_type=True)
        wire = msgpack.packb({"body": body, "sig": identity.sign(SIGNING_DOMAIN + body)}, use_bin_type=True)
        if len(wire) > MAX_DEMAND_BYTES:
            raise DemandError(f"demand record of {len(wire)} bytes exceeds {MAX_DEMAND_BYTES}")
        return DemandRecord(**{**self.__dict__, "signed": wire})

    def _check_shape(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise DemandError("malformed demand record: layers must be distinct and non-empty")
        if not 1 <= self.block_size <= self.n_expert:
            raise DemandError("malformed demand record: block size out of range")
        if len(self.unit_bytes) != len(self.layers) or any(b <= 0 for b in self.unit_bytes):
            raise DemandError("malformed demand record: one positive unit size per layer expected")
        n = len(self.layers) * self.n_blocks
        if n > MAX_UNITS or len(self.demand) != n:
            raise DemandError(f"malformed demand record: {len(self.demand)} demand values for {n} units")
        if not all(math.isfinite(d) and d >= 0 for d in self.demand):
            raise DemandError("malformed demand record: demand must be finite and non-negative")
        if self.lacks and len(self.lacks) != n:
            raise DemandError(f"malformed demand record: {len(self.lacks)} 'lacks' flags for {n} units")

    @classmethod
    def verify(cls, data: bytes, *, peer: str | None = None, now: float | None = None,
               allow_expired: bool = False) -> "DemandRecord":
        """Decode and check; DemandError (one line) for anything not to be trusted."""
        b, rpeer = open_signed(data, what="demand record", error=DemandError, max_bytes=MAX_DEMAND_BYTES,
                               version=DEMAND_VERSION, domain=SIGNING_DOMAIN, peer=peer)
        try:
            raw = b["demand"]
            if not isinstance(raw, bytes) or len(raw) % 4:
                raise ValueError
            ints = [b[k] for k in ("n_expert", "block_size", "seq", "issued", "expires")]
            lists = [b["layers"], b["unit_bytes"]]
            if (not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63 for x in ints)
                    or not all(isinstance(li, list) and len(li) <= MAX_UNITS for li in lists)
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 48
                               for li in lists for x in li)
                    or not isinstance(b["model"], str) or not 0 < len(b["model"]) <= 128):
                raise ValueError
            addrs, serves = b.get("addrs", []), b.get("serves_shards", False)
            if (not isinstance(addrs, list) or len(addrs) > MAX_ADDRS or not isinstance(serves, bool)
                    or not all(isinstance(a, str) and 0 < len(a) <= 256 for a in addrs)):
                raise ValueError
            lacks = b.get("lacks", b"")
            if not isinstance(lacks, bytes) or any(x > 1 for x in lacks):
                raise ValueError
            rec = cls(rpeer, b["model"], tuple(b["layers"]), b["n_expert"], b["block_size"], tuple(b["unit_bytes"]),
                      tuple(float(x) for x in np.frombuffer(raw, dtype="<f4")), b["seq"], b["issued"], b["expires"],
                      tuple(addrs), serves, bytes(data), tuple(bool(x) for x in lacks))
        except (KeyError, TypeError, ValueError):
            raise DemandError(f"malformed demand record of {rpeer[-12:]}") from None
        rec._check_shape()
        now = time.time() if now is None else now
        if rec.expires <= rec.issued or rec.expires - rec.issued > MAX_TTL_S:
            raise DemandError(f"demand record of {rpeer[-12:]} has a bad lifetime")
        if rec.issued > now + CLOCK_SKEW_S:
            raise DemandError(f"demand record of {rpeer[-12:]} is issued in the future")
        if not allow_expired and rec.expires < now:
            raise DemandError(f"demand record of {rpeer[-12:]} expired {int(now - rec.expires)} s ago")
        return rec


class DemandValidator:
    """DHT-side check of ``/p2pswarm/demand/<peer>`` values (see :class:`NodeRecordValidator`,
    which hands these keys to it): refuse forged, malformed, oversized or expired records; select
    the highest sequence number."""

    def __init__(self) -> None:
        self.rejected = 0

    def validate(self, key: str, value: bytes) -> None:
        try:
            DemandRecord.verify(value, peer=peer_of_demand_key(key))
        except DemandError as exc:
            self.rejected += 1
            log.warning("refused to store a demand record: %s", exc)
            raise

    def select(self, key: str, values: list[bytes]) -> int:
        return newest_index(values, lambda v: DemandRecord.verify(v, peer=peer_of_demand_key(key),
                                                                  allow_expired=True).seq)


def demand_vector(counter, layers, n_expert: int, block_size: int, now: float | None = None) -> list[float]:
    """Per-unit demand (layer-major) from a :class:`DemandCounter`: the sum over the unit's experts."""
    n_blocks = math.ceil(n_expert / block_size)
    out = np.zeros((len(layers), n_blocks))
    index = {layer: i for i, layer in enumerate(layers)}
    for (layer, expert), value in counter.top(n=1 << 30, now=now):
        if layer in index and 0 <= expert < n_expert:
            out[index[layer], expert // block_size] += value
    return [float(x) for x in out.reshape(-1)]


async def find_demand(dht, *, timeout_s: float = 20.0, allow_expired: bool = False,
                      known: "set[str] | None" = None) -> list[DemandRecord]:
    """Every live demand record the DHT holds (one per backbone, the newest), via :data:`MARKET_KEY`;
    ``allow_expired``: also a backbone's newest record when it has expired (its geometry still
    holds; its demand is stale). ``known``: backbones met before, whose records are read even when
    this provider look-up misses them; the backbones found are added to it."""
    import trio

    # Exhaustive, as for the model index: every backbone provides this one key, and each provide
    # reached the K closest peers *it* found, so no single holder is sure to list them all.
    infos = await dht.find_providers(MARKET_KEY, timeout_s=timeout_s, exhaustive=True)
    out: list[DemandRecord] = []

    async def one(peer: str) -> None:
        best, bad = None, []
        for v in await dht.get_values(demand_key(peer), timeout_s=timeout_s):
            try:
                rec = DemandRecord.verify(v, peer=peer, allow_expired=True)
            except DemandError as exc:
                bad.append(str(exc))
                continue
            if best is None or rec.seq > best.seq:
                best = rec
        for reason in bad:  # forged or malformed: worth a warning
            log.warning("ignored a demand record: %s", reason)
        # Stale copies linger at peers that were once among the closest: only the newest counts.
        if best is not None and (allow_expired or best.live()):
            out.append(best)
        elif best is not None:
            log.debug("demand record of %s expired %d s ago", peer[-12:], int(time.time() - best.expires))

    peers = {info.peer_id.to_base58() for info in infos} | set(known or ())
    async with trio.open_nursery() as nursery:
        for peer in sorted(peers):
            nursery.start_soon(one, peer)
    if known is not None:
        known.update(r.peer for r in out)
    return out


class DemandPublisher:
    """A backbone's side: publish its demand record now and every ``period_s`` (a third of the TTL
    by default), and provide :data:`MARKET_KEY` (re-provided every ``reprovide_s``, default: with
    every record)."""

    def __init__(self, dht, identity: Identity, counter, *, model: str, layers, n_expert: int, block_size: int,
                 unit_bytes, ttl_s: float = DEFAULT_DEMAND_TTL_S, period_s: float | None = None,
                 reprovide_s: float | None = None):
        if ttl_s < 3:
            raise UserError("demand record TTL must be at least 3 s")
        self.dht, self.identity, self.counter = dht, identity, counter
        self.model, self.layers, self.n_expert, self.block_size = model, list(layers), n_expert, block_size
        self.unit_bytes = list(unit_bytes)
        self.ttl_s = ttl_s
        self.period_s = period_s or ttl_s / 3
        if self.period_s >= ttl_s:
            raise UserError("demand re-publication period must be shorter than its TTL")
        # The market key is re-provided with every record by default: one look-up and 20 stores per
        # period. Provided rarely, it sits only at the peers that were closest when it was sent, and
        # once newer DHT servers are closer, look-ups converge on them and miss it.
        self.reprovide_s = self.period_s * 0.9 if reprovide_s is None else reprovide_s
        self.record: DemandRecord | None = None
        self.serves_shards = False  # set once the backbone serves shard downloads (node --manifest)
        #: () -> per-unit flags: the units the backbone's expert cache does not hold whole (None:
        #: it holds every expert; the record then carries no flags)
        self.lacks: Callable[[], Sequence[bool]] | None = None
        self.rounds = 0
        self._provided_at = -math.inf

    def _record(self) -> DemandRecord:
        seq = None if self.record is None else max(int(time.time() * 1000), self.record.seq + 1)
        return DemandRecord.make(self.identity, model=self.model, layers=self.layers, n_expert=self.n_expert,
                                 block_size=self.block_size, unit_bytes=self.unit_bytes,
                                 demand=demand_vector(self.counter, self.layers, self.n_expert, self.block_size),
                                 ttl_s=self.ttl_s, seq=seq, addrs=self.dht.net.addrs(),
                                 serves_shards=self.serves_shards, lacks=self.lacks() if self.lacks else ())

    async def publish(self) -> int:
        """Put a fresh record; provide the market key when due. Returns peers that stored the record."""
        self.record = self._record()
        self.rounds += 1
        stored = await self.dht.put_value(demand_key(self.identity.peer_id_str), self.record.signed)
        if not stored:
            log.warning("demand record reached no DHT peer; retrying in %.0f s", self.period_s)
        if time.monotonic() - self._provided_at >= self.reprovide_s:
            if await self.dht.provide(MARKET_KEY):
                self._provided_at = time.monotonic()
        return stored

    async def run(self, *, task_status=None) -> None:
        import trio

        from p2pswarm.net.libp2p.addrs import error_reason

        first = True
        while True:
            try:
                stored = await self.publish()
                if first:
                    log.info("published demand for %d units of model %s (stored at %d peers; every %.0f s, "
                             "TTL %.0f s)", len(self.record.demand) if self.record else 0, self.model[:12], stored, self.period_s, self.ttl_s)
            except (Exception, trio.TooSlowError) as exc:
                log.warning("publishing demand failed: %s", error_reason(exc))
            if first and task_status is not None:
                task_status.started()
            first = False
            await trio.sleep(self.period_s * random.uniform(0.9, 1.0))
