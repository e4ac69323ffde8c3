"""Coverage units, build fingerprints and the signed node records a backbone dials from.

Coverage unit: ``(model fingerprint, layer, expert block)`` with a swarm-wide block size
(:data:`DEFAULT_BLOCK_SIZE` experts). Its DHT key is a sha2-256 multihash of those four values, so
every node computes the same key without talking to anyone. A node *provides* (DHT provider record)
every unit its shards intersect; a backbone looks a unit's key up to learn who provides it. A node
also provides its model's :func:`model_key`, which names no block size: through it a backbone finds
the workers it cannot use because they were started with another block size, and says so.

A provider record says only "peer P claims unit U". What a backbone needs to use P - where to dial,
which exact experts, which build - is in P's **node record**, a DHT value under
``/p2pswarm/node/<peer id>``, signed by P's Ed25519 key (the one its peer id embeds). A backbone
trusts a provider only when P's node record verifies, is live (not expired, not withdrawn), names
the same protocol version and kernel, and lists a shard of the backbone's model that covers the
expert. Withdrawal on clean shutdown is a newer record with ``withdrawn: true``: Kademlia has no
"un-provide", and the provider records themselves linger on the DHT for 48 h.

Wire format of a node record (msgpack): ``{"body": bin, "sig": bin}``; ``sig`` is Ed25519 over
``b"p2pswarm-node-record-v1\\0" + body``; ``body`` is a msgpack map (see docs/protocol.md). Signing
the body bytes as sent (not a re-encoding) leaves no canonicalisation question.

No libp2p import here (importing any libp2p module costs ~0.8 s): socket workers and tools that
only check records stay light.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from typing import Protocol, TypeGuard

import msgpack
import multiaddr

from p2pswarm.errors import SwarmError, UserError
from p2pswarm.net.wire.expert_protocol import MAX_KERNEL_ID_CHARS
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.envelope import SignedError, open_sealed

log = logging.getLogger("p2pswarm.net")

RECORD_VERSION = 1
NAMESPACE = "p2pswarm"
NODE_RECORD_PREFIX = f"/{NAMESPACE}/node/"
SIGNING_DOMAIN = b"p2pswarm-node-record-v1\x00"
UNIT_KEY_DOMAIN = b"p2pswarm-unit-v1\x00"
DEFAULT_BLOCK_SIZE = 8  # experts per coverage unit, the same swarm-wide: 256 experts -> 32 blocks a layer
MODEL_KEY_DOMAIN = b"p2pswarm-model-v1\x00"
# A node record lives this long unless re-published (``node --ttl``); the advertiser re-publishes it
# every third of it, so a worker killed with SIGKILL drops out of every look-up within one TTL.
DEFAULT_RECORD_TTL_S = 60.0
MAX_RECORD_BYTES = 16 << 10
MAX_ADDRS = 16
MAX_SHARDS = 64
MAX_TTL_S = 7 * 24 * 3600
CLOCK_SKEW_S = 300
MAX_INDEX = 1 << 16  # layers and experts


class RecordError(UserError):
    """A node record that is malformed, forged, expired or otherwise unusable (one line)."""


@dataclass(frozen=True)
class BuildFingerprint:
    """What two peers must agree on before exchanging expert work."""

    protocol: int
    model: str
    shard: str
    kernel: str

    def short(self) -> str:
        return f"protocol {self.protocol}, model {self.model[:12]}, shard {self.shard[:12]}, kernel {self.kernel}"


@dataclass(frozen=True, order=True)
class CoverageUnit:
    model: str
    layer: int
    block: int
    block_size: int

    def key(self) -> bytes:
        """DHT key: a sha2-256 multihash (34 bytes), valid wherever Kademlia expects a key."""
        digest = hashlib.sha256(UNIT_KEY_DOMAIN + f"{self.model}\x00{self.layer}\x00{self.block}\x00{self.block_size}"
                                .encode()).digest()
        return b"\x12\x20" + digest

    @property
    def experts(self) -> range:
        return range(self.block * self.block_size, (self.block + 1) * self.block_size)

    def __str__(self) -> str:
        e = self.experts
        return f"layer {self.layer} experts {e.start}-{e.stop - 1}"


def model_key(model: str) -> bytes:
    """DHT provider key of "I serve experts of model M", whatever my block size (a multihash)."""
    return b"\x12\x20" + hashlib.sha256(MODEL_KEY_DOMAIN + model.lower().encode()).digest()


def units_for(model: str, layers: range | tuple[int, int], experts: range | tuple[int, int],
              block_size: int) -> list[CoverageUnit]:
    """Every unit a (layers x experts) rectangle intersects, layer-major."""
    if block_size <= 0:
        raise UserError(f"block size must be positive, got {block_size}")
    lb, le = (layers.start, layers.stop) if isinstance(layers, range) else layers
    eb, ee = (experts.start, experts.stop) if isinstance(experts, range) else experts
    if ee <= eb or le <= lb:
        return []
    blocks = range(eb // block_size, (ee - 1) // block_size + 1)
    return [CoverageUnit(model, layer, b, block_size) for layer in range(lb, le) for b in blocks]


@dataclass(frozen=True)
class ShardEntry:
    """One shard a node serves: a rectangle of (layers x experts) of one model."""

    model: str
    shard: str  # shard hash (see :func:`p2pswarm.model.layout.shard_hash`)
    layers: tuple[int, int]  # [begin, end)
    experts: tuple[int, int]  # [begin, end)

    def holds(self, layer: int, expert: int) -> bool:
        return self.layers[0] <= layer < self.layers[1] and self.experts[0] <= expert < self.experts[1]

    def to_wire(self) -> dict:
        return {"model": self.model, "shard": self.shard, "layers": list(self.layers), "experts": list(self.experts)}

    @classmethod
    def from_wire(cls, d: object) -> "ShardEntry":
        if not isinstance(d, dict):
            raise RecordError("malformed node record: a shard entry is not a map")
        model, shard, layers, experts = d.get("model"), d.get("shard"), d.get("layers"), d.get("experts")
        if not short_str(model) or not short_str(shard):
            raise RecordError("malformed node record: shard model/shard must be short strings")
        return cls(model, shard, _range(layers, "layers"), _range(experts, "experts"))


@dataclass(frozen=True)
class NodeRecord:
    """Who a peer is, where to dial it, what it serves - signed by that peer."""

    peer: str  # base58 peer id
    addrs: tuple[str, ...]  # multiaddrs without /p2p/
    protocol: int
    kernel: str
    block_size: int
    shards: tuple[ShardEntry, ...]
    seq: int  # higher wins; milliseconds since the epoch at signing
    issued: int  # unix seconds
    expires: int  # unix seconds
    withdrawn: bool = False
    signed: bytes = field(default=b"", compare=False, repr=False)  # the wire bytes, once signed/decoded

    # -- making ---------------------------------------------------------------------------------
    @classmethod
    def make(cls, identity: Identity, *, addrs, protocol: int, kernel: str, block_size: int, shards,
             ttl_s: float, withdrawn: bool = False, now: float | None = None, seq: int | None = None) -> "NodeRecord":
        now = time.time() if now is None else now
        rec = cls(identity.peer_id_str, tuple(addrs), protocol, kernel, block_size, tuple(shards),
                  seq if seq is not None else int(now * 1000), int(now), int(now + ttl_s), withdrawn)
        return rec.sign(identity)

    def body(self) -> dict:
        return {"v": RECORD_VERSION, "peer": self.peer, "addrs": list(self.addrs), "protocol": self.protocol,
                "kernel": self.kernel, "block_size": self.block_size, "shards": [s.to_wire() for s in self.shards],
                "seq": self.seq, "issued": self.issued, "expires": self.expires, "withdrawn": self.withdrawn}

    def sign(self, identity: Identity) -> "NodeRecord":
        if identity.peer_id_str != self.peer:
            raise RecordError("a node record can only be signed by the peer it describes")
        body = msgpack.packb(self.body(), use_bin_type=True)
        wire = msgpack.packb({"body": body, "sig": identity.sign(SIGNING_DOMAIN + body)}, use_bin_type=True)
        if len(wire) > MAX_RECORD_BYTES:
            raise RecordError(f"node record of {len(wire)} bytes exceeds {MAX_RECORD_BYTES}")
        # Read back as every peer will: a record the DHT would refuse must fail here, at start-up,
        # as one line, not be published and silently dropped by every peer (a worker nobody finds).
        NodeRecord.verify(wire, peer=self.peer, now=self.issued, allow_expired=True)
        return NodeRecord(**{**self.__dict__, "signed": wire})

    # -- reading --------------------------------------------------------------------------------
    @classmethod
    def verify(cls, data: bytes, *, peer: str | None = None, now: float | None = None,
               allow_expired: bool = False) -> "NodeRecord":
        """Decode and check a record; RecordError (one line) for anything we must not trust."""
        b, rpeer = open_signed(data, what="node record", error=RecordError, max_bytes=MAX_RECORD_BYTES,
                               version=RECORD_VERSION, domain=SIGNING_DOMAIN, peer=peer)
        try:
            rec = cls(
                peer=rpeer,
                addrs=tuple(_addrs(b.get("addrs"))),
                protocol=_int(b.get("protocol"), "protocol"),
                kernel=_str_field(b.get("kernel"), "kernel", MAX_KERNEL_ID_CHARS),
                block_size=_int(b.get("block_size"), "block_size", lo=1),
                shards=tuple(ShardEntry.from_wire(s) for s in _list(b.get("shards"), "shards", MAX_SHARDS)),
                seq=_int(b.get("seq"), "seq", hi=1 << 63),
                issued=_int(b.get("issued"), "issued", hi=1 << 40),
                expires=_int(b.get("expires"), "expires", hi=1 << 40),
                withdrawn=_bool(b.get("withdrawn"), "withdrawn"),
                signed=bytes(data),
            )
        except RecordError:
            raise
        except Exception as exc:  # defensive: any other shape problem
            raise RecordError(f"malformed node record: {type(exc).__name__}") from None
        now = time.time() if now is None else now
        if rec.expires <= rec.issued or rec.expires - rec.issued > MAX_TTL_S:
            raise RecordError(f"node record of {rpeer[-12:]} has a bad lifetime")
        if rec.issued > now + CLOCK_SKEW_S:
            raise RecordError(f"node record of {rpeer[-12:]} is issued in the future")
        if not allow_expired and rec.expires < now:
            raise RecordError(f"node record of {rpeer[-12:]} expired {int(now - rec.expires)} s ago")
        return rec

    # -- using ----------------------------------------------------------------------------------
    def live(self, now: float | None = None) -> bool:
        return not self.withdrawn and self.expires >= (time.time() if now is None else now)

    def shard_for(self, model: str, layer: int, expert: int) -> ShardEntry | None:
        return next((s for s in self.shards if s.model == model and s.holds(layer, expert)), None)

    def fingerprint(self, shard: ShardEntry) -> BuildFingerprint:
        return BuildFingerprint(self.protocol, shard.model, shard.shard, self.kernel)

    def unusable_reason(self, *, model: str, protocol: int, kernel: str, block_size: int) -> str | None:
        """Why a backbone of ``model`` running ``protocol``/``kernel``/``block_size`` cannot use
        this (verified, live) peer, or None. The wording matches the handshake's refusals."""
        if self.protocol != protocol:
            return f"protocol version mismatch: worker speaks {self.protocol}, we {protocol}"
        from p2pswarm.engine.kernels import compatible  # records stay free of the engine at import

        if not compatible(self.kernel, kernel):
            return f"kernel mismatch: worker computes with {self.kernel!r}, we with {kernel!r}"
        if self.block_size != block_size:
            return (f"block size mismatch: worker provides units of {self.block_size} experts, we look up "
                    f"units of {block_size} (start every node with the same --block-size)")
        if not any(s.model == model for s in self.shards):
            models = sorted({s.model for s in self.shards})
            return f"model mismatch: worker serves {', '.join(models) or 'no shard'}, we run {model}"
        return None

    def same_content(self, other: "NodeRecord | None") -> bool:
        """Whether ``other`` says the same as this record apart from its times and sequence number
        (a periodic re-publication rather than a restart with something new)."""
        return other is not None and (self.peer, self.addrs, self.protocol, self.kernel, self.block_size,
                                      self.shards, self.withdrawn) == (other.peer, other.addrs, other.protocol,
                                                                       other.kernel, other.block_size, other.shards,
                                                                       other.withdrawn)

    def units(self) -> list[CoverageUnit]:
        out: list[CoverageUnit] = []
        for s in self.shards:
            out.extend(units_for(s.model, s.layers, s.experts, self.block_size))
        return sorted(set(out))


def open_signed(data: bytes, *, what: str, error: type[UserError], max_bytes: int, version: int, domain: bytes,
                peer: str | None) -> tuple[dict, str]:
    """Open a signed record (:func:`p2pswarm.net.signed.envelope.open_sealed`, signer in ``body["peer"]``),
    then check its version and, given ``peer``, that it names that peer; returns (body map, signer
    peer id). ``error`` (one line naming ``what``) for anything else. Node and demand records use it."""
    try:
        b = open_sealed(data, domain, signer_field="peer", what=what, max_bytes=max_bytes)
    except SignedError as exc:
        raise error(str(exc)) from None
    if b.get("v") != version:
        raise error(f"{what} version {b.get('v')!r} is not {version}")
    rpeer = b["peer"]
    if peer is not None and rpeer != peer:
        raise error(f"{what} names peer {rpeer[-12:]}, expected {peer[-12:]}")
    return b, rpeer


def node_record_key(peer) -> str:
    """DHT key of a peer's node record (``peer``: base58 string or libp2p ID)."""
    return NODE_RECORD_PREFIX + (peer.to_base58() if hasattr(peer, "to_base58") else str(peer))


def peer_of_record_key(key: str) -> str | None:
    return key[len(NODE_RECORD_PREFIX):] if key.startswith(NODE_RECORD_PREFIX) else None


class RecordKind(Protocol):
    """Another signed record kind in the ``/p2pswarm/`` namespace (the market's demand and ban
    records): the two methods of a py-libp2p ``Validator``. ``validate`` raises a UserError for a
    value not to be stored; ``select`` gives the index of the value to keep."""

    def validate(self, key: str, value: bytes) -> None: ...

    def select(self, key: str, values: list[bytes]) -> int: ...


class NodeRecordValidator:
    """(A py-libp2p ``Validator``: it only needs these two methods.) The DHT-side check for
    ``/p2pswarm/...`` values: a DHT server running it refuses to store a forged, malformed or
    foreign-keyed record, and ``select`` keeps the newest (highest seq). ``rejected`` counts
    refusals (the resolver reports them).

    ``kinds`` (key prefix -> :class:`RecordKind`): the other record kinds, each key starting with
    a prefix going to that kind's validator. Given at construction because they are defined above
    the network layer (:func:`p2pswarm.market.swarm_dht.record_kinds` is the swarm's set); a key
    of no kind given and not a node record's is refused."""

    def __init__(self, kinds: Mapping[str, RecordKind]) -> None:
        self.rejected = 0
        self.kinds = dict(kinds)

    def _other_kind(self, key: str) -> RecordKind | None:
        return next((v for prefix, v in self.kinds.items() if key.startswith(prefix)), None)

    def validate(self, key: str, value: bytes) -> None:
        other = self._other_kind(key)
        if other is not None:
            try:
                return other.validate(key, value)
            except SwarmError:
                self.rejected += 1
                raise
        peer = peer_of_record_key(key)
        try:
            if peer is None:
                raise RecordError(f"unknown key {key[:40]!r} in the {NAMESPACE} namespace")
            NodeRecord.verify(value, peer=peer)
        except RecordError as exc:
            self.rejected += 1
            log.warning("refused to store a DHT record: %s", exc)
            raise

    def select(self, key: str, values: list[bytes]) -> int:
        other = self._other_kind(key)
        if other is not None:
            return other.select(key, values)
        return newest_index(values, lambda v: NodeRecord.verify(v, peer=peer_of_record_key(key),
                                                                allow_expired=True).seq)


def newest_index(values: list[bytes], seq_of: Callable[[bytes], int]) -> int:
    """Index of the value with the highest sequence number (``seq_of`` raises UserError for a
    value that does not verify; such values are skipped); 0 when none verifies."""
    best, best_seq = 0, -1
    for i, v in enumerate(values):
        try:
            seq = seq_of(v)
        except SwarmError:
            continue
        if seq > best_seq:
            best, best_seq = i, seq
    return best


# -- field checks ---------------------------------------------------------------------------------
def short_str(x: object, n: int = 128) -> TypeGuard[str]:
    """A non-empty str of at most ``n`` characters (the shape check of every signed-message field)."""
    return isinstance(x, str) and 0 < len(x) <= n


def _str_field(x: object, what: str, n: int = 128) -> str:
    if not short_str(x, n):
        raise RecordError(f"malformed node record: {what} must be a short string")
    return x


def _int(x: object, what: str, lo: int = 0, hi: int = MAX_INDEX) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise RecordError(f"malformed node record: {what} must be an integer in [{lo}, {hi}]")
    return x


def _bool(x: object, what: str) -> bool:
    if not isinstance(x, bool):
        raise RecordError(f"malformed node record: {what} must be a boolean")
    return x


def _list(x: object, what: str, n: int) -> list:
    if not isinstance(x, list) or len(x) > n:
        raise RecordError(f"malformed node record: {what} must be a list of at most {n}")
    return x


def _range(x: object, what: str) -> tuple[int, int]:
    if not isinstance(x, list) or len(x) != 2:
        raise RecordError(f"malformed node record: {what} must be [begin, end)")
    b, e = _int(x[0], what), _int(x[1], what)
    if b >= e:
        raise RecordError(f"malformed node record: empty {what} range [{b}, {e})")
    return b, e


def _addrs(x: object) -> list[str]:
    out = []
    for a in _list(x, "addrs", MAX_ADDRS):
        if not short_str(a, 256):
            raise RecordError("malformed node record: an address is not a short string")
        try:
            ma = multiaddr.Multiaddr(a)
        except Exception:
            raise RecordError(f"malformed node record: bad address {a[:60]!r}") from None
        names = [p.name for p in ma.protocols()]
        # A relayed address names its relay (``RELAY/p2p/RELAY_ID/p2p-circuit``); only that /p2p/.
        relayed = names[-1:] == ["p2p-circuit"] and names.count("p2p") == 1 and names[-2:-1] == ["p2p"]
        if "p2p" in names and not relayed:
            raise RecordError("malformed node record: addresses must not carry /p2p/")
        out.append(a)
    return out
