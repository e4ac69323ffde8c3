"""Signed msgpack envelopes for every signed record (node and demand records, receipts, bans):
``{"body": bin, "sig": bin}``.

``sig`` is Ed25519 over ``domain + body`` by the peer the body names as its signer, checked against
the public key its peer id embeds. Signing the
body bytes as sent leaves no canonicalisation question, and a per-type domain keeps a signature of
one record type from ever verifying as another. No libp2p import: the `rewards` command stays light.
"""
from __future__ import annotations

import msgpack

from p2pswarm.errors import UserError
from p2pswarm.net.signed.identity import Identity
from p2pswarm.signatures import verify_peer_signature


class SignedError(UserError):
    """A malformed, forged or otherwise unusable signed record (one line)."""


def seal(identity: Identity, domain: bytes, body: dict, *, max_bytes: int) -> bytes:
    """The wire bytes of ``body`` signed by ``identity`` under ``domain``."""
    raw = msgpack.packb(body, use_bin_type=True)
    wire = msgpack.packb({"body": raw, "sig": identity.sign(domain + raw)}, use_bin_type=True)
    if len(wire) > max_bytes:
        raise SignedError(f"signed record of {len(wire)} bytes exceeds {max_bytes}")
    return wire


def open_sealed(data: object, domain: bytes, *, signer_field: str, what: str, max_bytes: int) -> dict:
    """The body of a sealed record whose signature by ``body[signer_field]`` verifies; SignedError
    (one line, naming ``what``) for anything else. The signature is checked before any field is
    trusted; callers check the fields."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > max_bytes:
        raise SignedError(f"malformed {what}: not bytes, or too large (over {max_bytes} bytes)")
    try:
        outer = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise SignedError(f"malformed {what}: {type(exc).__name__}") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), bytes) or not isinstance(outer.get("sig"), bytes):
        raise SignedError(f"malformed {what}: expected a map of body and sig bytes")
    try:
        body = msgpack.unpackb(outer["body"], raw=False, strict_map_key=True)
    except Exception as exc:
        raise SignedError(f"malformed {what} body: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise SignedError(f"malformed {what} body: not a map")
    signer = body.get(signer_field)
    if not isinstance(signer, str) or not 0 < len(signer) <= 128:
        raise SignedError(f"malformed {what}: no {signer_field} peer id")
    try:
        good = verify_peer_signature(signer, domain + outer["body"], outer["sig"])
    except Exception:  # an unparseable peer id
        good = False
    if not good:
        raise SignedError(f"{what} signed as {signer[-12:]} has a bad signature (forged or corrupted)")
    return body


def field_int(body: dict, key: str, what: str, lo: int = 0, hi: int = 1 << 63) -> int:
    x = body.get(key)
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise SignedError(f"malformed {what}: {key} must be an integer in [{lo}, {hi}]")
    return x


def field_str(body: dict, key: str, what: str, n: int = 128) -> str:
    x = body.get(key)
    if not isinstance(x, str) or not 0 < len(x) <= n:
        raise SignedError(f"malformed {what}: {key} must be a string of 1-{n} characters")
    return x
