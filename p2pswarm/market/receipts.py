"""Signed contribution receipts: what a backbone owes each worker, in rows computed and bytes served.

The backbone's :class:`ContributionLedger` counts, per worker peer id, the expert rows it computed,
the result bytes it sent and the requests it answered - only answers the backbone *used* (a reply
that failed verification counts nothing). Every period it signs a :class:`Receipt` per worker with
new work and sends it to that worker (the ``receipt`` op on the expert stream, docs/protocol.md); the
worker's :class:`ReceiptStore` writes it to disk atomically (temporary file, fsync, rename, fsync of
the directory), so a crash loses at most the receipt in flight, never a stored one.

Receipts of one backbone run form a chain: ``epoch`` names the run (its start, in ms), ``seq`` counts
1, 2, 3 ... within it, and each receipt carries the period's counts *and* the running totals, so
:func:`check_receipts` can prove the totals add up and spot a missing receipt. A backbone that bans a
worker voids its unpaid receipts (from ``voids_from_seq`` of the epoch on, in the ban record; nothing
settles receipts yet, so that is all of them) and issues it no more.

Wire format (msgpack): ``{"body": bin, "sig": bin}``, ``sig`` = Ed25519 over
``b"p2pswarm-receipt-v1\\0" + body`` by the backbone; body fields in docs/protocol.md.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import builtins
from dataclasses import dataclass, field
from typing import cast
from pathlib import Path

from p2pswarm import settings
from p2pswarm.net.signed.envelope import SignedError, field_int, field_str, open_sealed, seal
from p2pswarm.net.signed.identity import Identity

log = logging.getLogger("p2pswarm.market")

RECEIPT_VERSION = 1
RECEIPT_DOMAIN = b"p2pswarm-receipt-v1\x00"
MAX_RECEIPT_BYTES = 4096
RECEIPT_SUFFIX = ".receipt"


@dataclass(frozen=True)
class Receipt:
    backbone: str  # signer's peer id
    worker: str  # the worker's peer id
    model: str  # model fingerprint
    epoch: int  # the backbone run (ms since the epoch at its start)
    seq: int  # 1, 2, 3 ... within the epoch
    period_start: int  # unix ms
    period_end: int  # unix ms
    rows: int  # expert rows computed in this period
    bytes: int  # result bytes served in this period
    requests: int
    total_rows: int  # running totals over the epoch, this period included
    total_bytes: int
    total_requests: int
    signed: builtins.bytes = field(default=b"", compare=False, repr=False)  # (``bytes`` is a field here)

    def body(self) -> dict:
        return {"v": RECEIPT_VERSION, "backbone": self.backbone, "worker": self.worker, "model": self.model,
                "epoch": self.epoch, "seq": self.seq, "period_start": self.period_start,
                "period_end": self.period_end, "rows": self.rows, "bytes": self.bytes, "requests": self.requests,
                "total_rows": self.total_rows, "total_bytes": self.total_bytes,
                "total_requests": self.total_requests}

    def sign(self, identity: Identity) -> "Receipt":
        if identity.peer_id_str != self.backbone:
            raise SignedError("a receipt can only be signed by the backbone it names")
        return Receipt(**{**self.__dict__, "signed": seal(identity, RECEIPT_DOMAIN, self.body(),
                                                          max_bytes=MAX_RECEIPT_BYTES)})

    @classmethod
    def verify(cls, data: object, *, worker: str | None = None, backbone: str | None = None) -> "Receipt":
        """Decode and check a receipt (signature first, then every field); SignedError otherwise."""
        what = "receipt"
        b = open_sealed(data, RECEIPT_DOMAIN, signer_field="backbone", what=what, max_bytes=MAX_RECEIPT_BYTES)
        if b.get("v") != RECEIPT_VERSION:
            raise SignedError(f"receipt version {b.get('v')!r} is not {RECEIPT_VERSION}")
        n = {k: field_int(b, k, what) for k in ("epoch", "seq", "period_start", "period_end", "rows", "bytes",
                                                "requests", "total_rows", "total_bytes", "total_requests")}
        r = cls(field_str(b, "backbone", what), field_str(b, "worker", what), field_str(b, "model", what),
                n["epoch"], n["seq"], n["period_start"], n["period_end"], n["rows"], n["bytes"], n["requests"],
                n["total_rows"], n["total_bytes"], n["total_requests"],
                signed=bytes(cast(bytes, data)))  # (open_sealed refused anything but bytes)
        if r.seq < 1 or r.period_end < r.period_start:
            raise SignedError(f"malformed receipt: seq {r.seq} or period [{r.period_start}, {r.period_end}]")
        if r.total_rows < r.rows or r.total_bytes < r.bytes or r.total_requests < r.requests:
            raise SignedError(f"receipt {r.seq} of {r.backbone[-12:]}: totals smaller than the period's counts")
        if worker is not None and r.worker != worker:
            raise SignedError(f"receipt names worker {r.worker[-12:]}, not {worker[-12:]}")
        if backbone is not None and r.backbone != backbone:
            raise SignedError(f"receipt signed by {r.backbone[-12:]} arrived from {backbone[-12:]}")
        return r


# ------------------------------------------------------------------------------------------------
# Backbone side
# ------------------------------------------------------------------------------------------------
@dataclass
class _Account:
    rows: int = 0
    bytes: int = 0
    requests: int = 0
    since_ms: int = 0
    total_rows: int = 0
    total_bytes: int = 0
    total_requests: int = 0
    seq: int = 0
    unsent: list = field(default_factory=list)  # receipts signed but not yet acknowledged
    issued: list = field(default_factory=list)  # every receipt of this epoch (what a ban voids)
    paid_through: int = 0  # highest seq settled; nothing settles receipts yet
    banned: bool = False


class ContributionLedger:
    """Per worker: the work the backbone used since its last receipt, and its receipt chain."""

    def __init__(self, identity: Identity, model: str, *, now_ms: int | None = None):
        self.identity = identity
        self.model = model
        self.epoch = int(time.time() * 1000) if now_ms is None else now_ms
        self.accounts: dict[str, _Account] = {}

    def add(self, worker: str, rows: int, nbytes: int) -> None:
        a = self.accounts.setdefault(worker, _Account(since_ms=int(time.time() * 1000)))
        if a.banned:
            return
        a.rows += rows
        a.bytes += nbytes
        a.requests += 1

    def issue(self, now_ms: int | None = None) -> list[Receipt]:
        """Sign a receipt for every worker with work since its last one; returns them (each also
        waits in its account's ``unsent`` list until :meth:`delivered`)."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        out = []
        for worker, a in self.accounts.items():
            if a.banned or a.requests == 0:
                continue
            a.seq += 1
            a.total_rows += a.rows
            a.total_bytes += a.bytes
            a.total_requests += a.requests
            r = Receipt(self.identity.peer_id_str, worker, self.model, self.epoch, a.seq, a.since_ms,
                        max(now_ms, a.since_ms), a.rows, a.bytes, a.requests, a.total_rows, a.total_bytes,
                        a.total_requests).sign(self.identity)
            a.rows = a.bytes = a.requests = 0
            a.since_ms = now_ms
            a.unsent.append(r)
            a.issued.append(r)
            out.append(r)
        return out

    def pending(self) -> dict[str, list[Receipt]]:
        return {w: list(a.unsent) for w, a in self.accounts.items() if a.unsent and not a.banned}

    def delivered(self, worker: str, seq: int) -> None:
        a = self.accounts.get(worker)
        if a is not None:
            a.unsent = [r for r in a.unsent if r.seq != seq]

    def void(self, worker: str) -> tuple[int, int]:
        """Void ``worker``'s unpaid receipts and stop counting its work; returns ``(voids_from_seq,
        receipts voided)`` for the ban record."""
        a = self.accounts.setdefault(worker, _Account())
        a.banned = True
        a.rows = a.bytes = a.requests = 0
        a.unsent = []
        voided = [r for r in a.issued if r.seq > a.paid_through]
        return a.paid_through + 1, len(voided)


class ReceiptIssuer:
    """Every ``period_s``: sign receipts for new work and send every undelivered one through
    ``send(worker, data) -> bool`` (True once the worker acknowledged storing it)."""

    def __init__(self, ledger: ContributionLedger, send, *, period_s: float = 60.0):
        self.ledger = ledger
        self.send = send
        self.period_s = period_s
        self.sent = 0

    async def round(self) -> int:
        self.ledger.issue()
        delivered = 0
        for worker, receipts in self.ledger.pending().items():
            for r in receipts:
                if not await self.send(worker, r.signed):
                    break  # keep the rest for the next round, in order
                self.ledger.delivered(worker, r.seq)
                delivered += 1
        self.sent += delivered
        return delivered

    async def run(self) -> None:
        import trio  # the module stays importable without trio for the CLI

        while True:
            await trio.sleep(self.period_s)
            n = await self.round()
            if n:
                log.info("sent %d contribution receipts", n)


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------
def default_receipts_dir() -> Path:
    return settings.home_dir() / "receipts"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReceiptStore:
    """A worker's receipts on disk: ``DIR/<backbone peer id>/<epoch>-<seq>.receipt``, the signed bytes."""

    def __init__(self, directory: str | os.PathLike[str], worker: str):
        self.dir = Path(directory)
        self.worker = worker
        self.stored = 0

    def path_of(self, r: Receipt) -> Path:
        return self.dir / r.backbone / f"{r.epoch:013d}-{r.seq:09d}{RECEIPT_SUFFIX}"

    def save(self, data: bytes, sender: str | None = None) -> Receipt:
        """Verify a receipt from ``sender`` (the authenticated peer that sent it) naming us, and
        store it durably; the same receipt twice is stored once. SignedError if it does not verify."""
        r = Receipt.verify(data, worker=self.worker, backbone=sender)
        path = self.path_of(r)
        if path.exists():
            if path.read_bytes() != r.signed:
                log.warning("backbone %s signed two different receipts %d of epoch %d: kept the first",
                            r.backbone, r.seq, r.epoch)
            return r
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(r.signed)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        self.stored += 1
        return r


@dataclass
class ChainReport:
    worker: str
    backbone: str
    epoch: int
    receipts: int
    rows: int
    bytes: int
    requests: int
    first_seq: int
    last_seq: int
    problems: list[str]
    voided_from: int | None = None  # a ban by this backbone voids receipts from this seq on

    def to_json(self) -> dict:
        return dict(self.__dict__)


def load_receipts(directory: str | os.PathLike[str]) -> tuple[list[Receipt], list[str]]:
    """Every receipt file under ``directory``, verified; and one error line per bad file."""
    root = Path(directory)
    receipts, errors = [], []
    for path in sorted(root.rglob(f"*{RECEIPT_SUFFIX}")):
        try:
            r = Receipt.verify(path.read_bytes())
            if path.parent.name != r.backbone:
                raise SignedError(f"signed by {r.backbone[-12:]} but filed under {path.parent.name[-12:]}")
            receipts.append(r)
        except (SignedError, OSError) as exc:
            errors.append(f"{path}: {exc}")
    return receipts, errors


def check_receipts(receipts: list[Receipt]) -> list[ChainReport]:
    """Group by (worker, backbone, epoch) and check each chain: one model, contiguous seqs from 1,
    running totals equal to the sums of the periods' counts."""
    chains: dict[tuple[str, str, int], list[Receipt]] = {}
    for r in receipts:
        chains.setdefault((r.worker, r.backbone, r.epoch), []).append(r)
    out = []
    for (worker, backbone, epoch), rs in sorted(chains.items()):
        rs.sort(key=lambda r: r.seq)
        problems: list[str] = []
        if len({r.seq for r in rs}) != len(rs):
            problems.append("two different receipts with one seq")
        if len({r.model for r in rs}) > 1:
            problems.append("receipts name different models")
        rows = nbytes = reqs = 0
        prev = 0
        for r in rs:
            if r.seq != prev + 1:
                problems.append(f"receipts {prev + 1}-{r.seq - 1} missing")
                rows, nbytes, reqs = r.total_rows - r.rows, r.total_bytes - r.bytes, r.total_requests - r.requests
            rows, nbytes, reqs = rows + r.rows, nbytes + r.bytes, reqs + r.requests
            if (rows, nbytes, reqs) != (r.total_rows, r.total_bytes, r.total_requests):
                problems.append(f"receipt {r.seq}: totals {r.total_rows} rows/{r.total_bytes} B do not add up "
                                f"(sum of periods {rows} rows/{nbytes} B)")
                rows, nbytes, reqs = r.total_rows, r.total_bytes, r.total_requests
            prev = r.seq
        last = rs[-1]
        out.append(ChainReport(worker, backbone, epoch, len(rs), last.total_rows, last.total_bytes, last.total_requests,
                               rs[0].seq, last.seq, problems))
    return out
