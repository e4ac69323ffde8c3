"""Swarm-wide bans of workers caught returning wrong numbers: signed ban records in the DHT.

A backbone whose verification (:mod:`p2pswarm.market.verify`) catches a worker signs a
:class:`BanRecord` (banning backbone, banned peer, model, sha256 of the evidence, a one-line
summary, time, which receipts it voids) and stores it under ``/p2pswarm/ban/<banned>/<backbone>``.
The key names the signer, and every DHT server's validator refuses a record whose signature is
not that backbone's (or that is malformed, or names another peer than its key): so nobody can
write a ban in another backbone's name, and a DHT node keeps at most one ban per (banned, banner).

Which bans a backbone *honours* is its own choice: its own, and those of the backbones it trusts
(``--trust-bans PEER_ID``). Anyone can sign a ban, so honouring every signed one would let any
peer switch off any worker. :class:`BanKeeper` looks up the ban keys of every worker in the
coverage map for each trusted banner - before the first request to a newly found worker, and every
``refresh_s`` - and the dispatcher then sends that peer nothing (its experts go to a replica or the
local replica, exact either way).

Wire format (msgpack): ``{"body": bin, "sig": bin}``, ``sig`` = Ed25519 over
``b"p2pswarm-ban-v1\\0" + body`` by the banning backbone; body fields in docs/protocol.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from p2pswarm.net.signed.envelope import SignedError, field_int, field_str, open_sealed, seal
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import NAMESPACE, RecordError

if TYPE_CHECKING:  # for the annotation only: the async methods import trio where they run
    import trio

log = logging.getLogger("p2pswarm.market")

BAN_VERSION = 1
BAN_DOMAIN = b"p2pswarm-ban-v1\x00"
BAN_PREFIX = f"/{NAMESPACE}/ban/"
MAX_BAN_BYTES = 4096
BAN_TTL_S = 7 * 24 * 3600  # a ban lives a week unless re-published (a running backbone re-publishes it)
CLOCK_SKEW_S = 300


def ban_key(banned: str, backbone: str) -> str:
    return f"{BAN_PREFIX}{banned}/{backbone}"


def parse_ban_key(key: str) -> tuple[str, str] | None:
    if not key.startswith(BAN_PREFIX):
        return None
    parts = key[len(BAN_PREFIX):].split("/")
    return (parts[0], parts[1]) if len(parts) == 2 and all(parts) else None


@dataclass(frozen=True)
class BanRecord:
    backbone: str  # the banning backbone (signer)
    banned: str  # the banned worker's peer id
    model: str
    evidence: str  # hex sha256 of the evidence (see verify.Evidence.digest)
    reason: str  # one line: where the mismatch was and how large
    issued: int  # unix s
    expires: int  # unix s
    voids_epoch: int  # the banning backbone's receipt epoch whose receipts are void ...
    voids_from_seq: int  # ... from this seq on
    signed: bytes = field(default=b"", compare=False, repr=False)

    @classmethod
    def make(cls, identity: Identity, *, banned: str, model: str, evidence: str, reason: str, voids_epoch: int,
             voids_from_seq: int, now: float | None = None, ttl_s: float = BAN_TTL_S) -> "BanRecord":
        now = time.time() if now is None else now
        rec = cls(identity.peer_id_str, banned, model, evidence, reason[:300], int(now), int(now + ttl_s),
                  voids_epoch, voids_from_seq)
        return cls(**{**rec.__dict__, "signed": seal(identity, BAN_DOMAIN, rec.body(), max_bytes=MAX_BAN_BYTES)})

    def body(self) -> dict:
        return {"v": BAN_VERSION, "backbone": self.backbone, "banned": self.banned, "model": self.model,
                "evidence": self.evidence, "reason": self.reason, "issued": self.issued, "expires": self.expires,
                "voids_epoch": self.voids_epoch, "voids_from_seq": self.voids_from_seq}

    @property
    def key(self) -> str:
        return ban_key(self.banned, self.backbone)

    @classmethod
    def verify(cls, data: object, *, key: str | None = None, now: float | None = None,
               allow_expired: bool = False) -> "BanRecord":
        """Decode and check a ban (signature first); SignedError (one line) for anything untrusted."""
        what = "ban record"
        b = open_sealed(data, BAN_DOMAIN, signer_field="backbone", what=what, max_bytes=MAX_BAN_BYTES)
        if b.get("v") != BAN_VERSION:
            raise SignedError(f"ban record version {b.get('v')!r} is not {BAN_VERSION}")
        rec = cls(field_str(b, "backbone", what), field_str(b, "banned", what), field_str(b, "model", what),
                  field_str(b, "evidence", what, 64), field_str(b, "reason", what, 300),
                  field_int(b, "issued", what, hi=1 << 40), field_int(b, "expires", what, hi=1 << 40),
                  field_int(b, "voids_epoch", what), field_int(b, "voids_from_seq", what, lo=1),
                  signed=bytes(cast(bytes, data)))  # (open_sealed refused anything but bytes)
        if key is not None and parse_ban_key(key) != (rec.banned, rec.backbone):
            raise SignedError(f"ban record of {rec.banned[-12:]} by {rec.backbone[-12:]} stored under another key")
        now = time.time() if now is None else now
        if rec.expires <= rec.issued or rec.issued > now + CLOCK_SKEW_S:
            raise SignedError(f"ban record by {rec.backbone[-12:]} has a bad lifetime")
        if not allow_expired and rec.expires < now:
            raise SignedError(f"ban record by {rec.backbone[-12:]} expired")
        return rec


class BanValidator:
    """(A py-libp2p ``Validator``.) What a DHT server stores under ``/p2pswarm/ban/``: only bans
    signed by the backbone their key names; ``select`` keeps the newest."""

    def __init__(self) -> None:
        self.rejected = 0

    def validate(self, key: str, value: bytes) -> None:
        try:
            BanRecord.verify(value, key=key)
        except SignedError as exc:
            self.rejected += 1
            log.warning("refused to store a DHT ban record: %s", exc)
            raise RecordError(str(exc)) from None

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_issued = 0, -1
        for i, v in enumerate(values):
            try:
                issued = BanRecord.verify(v, key=key, allow_expired=True).issued
            except SignedError:
                continue
            if issued > best_issued:
                best, best_issued = i, issued
        return best


class BanKeeper:
    """A backbone's bans: the ones it issues (published to the DHT, re-published while it runs) and
    the ones it honours (its own and those of ``trusted`` backbones), applied to ``bans`` (the
    dispatcher's ban list, p2pswarm.backbone.dispatch.verify.Bans: ``ban(peer, reason)``)."""

    def __init__(self, identity: Identity, model: str, bans, *, dht=None, trusted=(), ledger=None,
                 refresh_s: float = 30.0, republish_s: float = 6 * 3600.0):
        self.identity = identity
        self.model = model
        self.bans = bans
        self.dht = dht
        self.trusted = [identity.peer_id_str, *[t for t in trusted if t != identity.peer_id_str]]
        self.ledger = ledger
        self.refresh_s = refresh_s
        self.republish_s = republish_s
        self.issued: dict[str, BanRecord] = {}  # banned peer -> our ban
        self.honoured: dict[str, BanRecord] = {}  # banned peer -> the ban we act on
        self._checked: set[str] = set()
        self._publish_queue: list[BanRecord] = []
        self._wake: trio.Event | None = None  # set while run() waits: a new ban wakes it
        self.published = 0

    def ban(self, peer: str, evidence) -> BanRecord:
        """Ban ``peer`` at once in this backbone (no more requests), void its unpaid receipts, log
        the evidence, and queue the signed record for the DHT (the step never waits on the DHT)."""
        if self.ledger is not None:
            epoch = self.ledger.epoch
            voids_from, voided = self.ledger.void(peer)
        else:
            epoch, voids_from, voided = 0, 1, 0
        rec = BanRecord.make(self.identity, banned=peer, model=self.model, evidence=evidence.digest(),
                             reason=evidence.summary(), voids_epoch=epoch, voids_from_seq=voids_from)
        self.issued[peer] = rec
        self._honour(rec, own=True)
        log.warning("BANNED worker %s: %s; evidence %s; voided %d unpaid receipts (epoch %d from seq %d)",
                    peer, evidence.summary(), rec.evidence[:16], voided, epoch, voids_from)
        self._publish_queue.append(rec)
        if self._wake is not None:
            self._wake.set()
        return rec

    def _honour(self, rec: BanRecord, own: bool = False) -> None:
        if rec.banned in self.honoured:
            return
        self.honoured[rec.banned] = rec
        self.bans.ban(rec.banned, f"banned by {'us' if own else rec.backbone}: {rec.reason}")
        if self.ledger is not None and not own:
            self.ledger.void(rec.banned)
        if not own:
            log.warning("honouring the ban of worker %s by backbone %s (%s): it gets no requests", rec.banned,
                        rec.backbone, rec.reason)

    def is_banned(self, peer: str) -> bool:
        return peer in self.honoured

    async def check(self, peers, *, force: bool = False) -> int:
        """Look up the bans of ``peers`` by every trusted backbone (peers already checked are
        skipped unless ``force``); returns how many new bans are honoured."""
        import trio

        if self.dht is None:
            return 0
        todo = [p for p in dict.fromkeys(peers) if p not in self.honoured and (force or p not in self._checked)]
        before = len(self.honoured)

        async def one(peer: str, banner: str) -> None:
            key = ban_key(peer, banner)
            try:
                values = await self.dht.get_values(key, timeout_s=10.0)
            except Exception as exc:  # a failed look-up is retried on the next refresh
                log.debug("ban look-up %s failed: %s", key[:60], exc)
                return
            for v in values:
                try:
                    rec = BanRecord.verify(v, key=key)
                except SignedError as exc:
                    log.warning("ignored a ban record of %s: %s", peer, exc)
                    continue
                if rec.model == self.model:
                    self._honour(rec, own=rec.backbone == self.identity.peer_id_str)
                    return

        async with trio.open_nursery() as nursery:
            for peer in todo:
                self._checked.add(peer)
                for banner in self.trusted:
                    nursery.start_soon(one, peer, banner)
        return len(self.honoured) - before

    async def publish_pending(self) -> None:
        while self._publish_queue:
            rec = self._publish_queue.pop(0)
            if self.dht is None:
                continue
            try:
                n = await self.dht.put_value(rec.key, rec.signed)
                self.published += 1
                log.info("published the ban of %s to the DHT (%d peers stored it)", rec.banned, n)
            except Exception as exc:
                log.warning("publishing the ban of %s failed (%s): retrying", rec.banned, exc)
                self._publish_queue.append(rec)
                return

    async def run(self, peers_of, *, task_status=None) -> None:
        """Publish our bans as they come, re-publish them every ``republish_s``, and check
        ``peers_of()`` (the coverage map's peers) every ``refresh_s``."""
        import trio

        self._wake = trio.Event()
        if task_status is not None:
            task_status.started()
        last_republish = time.monotonic()
        while True:
            with trio.move_on_after(self.refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.publish_pending()
            if time.monotonic() - last_republish > self.republish_s:
                last_republish = time.monotonic()
                self._publish_queue.extend(self.issued.values())
                await self.publish_pending()
            await self.check(peers_of(), force=True)
