"""Ed25519 signatures made by libp2p peer ids: the public key an Ed25519 peer id embeds, and the
check that a signature over some bytes is that key's.

Why here, below every package: the model's manifest, the node tokens, and every signed DHT record
(node, demand, ban, receipt) check signatures by peer id, so the check must not live in the network
layer that only some of them use. Pure Python over ``cryptography`` and ``base58``: no libp2p
import (that costs ~0.8 s), so tools and socket workers that only check a signature stay light.
"""
from __future__ import annotations

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from p2pswarm.errors import SwarmError, UserError, clip

# An Ed25519 libp2p peer id is an identity multihash of the protobuf PublicKey
# {Type: Ed25519 (1), Data: 32 bytes}: 00 24 | 08 01 12 20 | key.
_ED25519_PEER_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


def peer_id_bytes(peer_id) -> bytes:
    """The raw multihash of a peer id given as bytes, a libp2p ID or base58 text; one line for a
    malformed one (ids come from the command line and from peers' messages)."""
    if isinstance(peer_id, (bytes, bytearray)):
        return bytes(peer_id)
    if hasattr(peer_id, "to_bytes"):
        return peer_id.to_bytes()
    try:
        return base58.b58decode(str(peer_id))
    except Exception:
        raise UserError(f"malformed peer id {clip(peer_id, 80)!r}") from None


def peer_public_key(peer_id) -> ed25519.Ed25519PublicKey:
    """The Ed25519 public key a peer id (base58 string, bytes or libp2p ID) embeds; UserError if
    it embeds none (e.g. a hashed RSA id): only Ed25519 identities can sign our records."""
    raw = peer_id_bytes(peer_id)
    if len(raw) != len(_ED25519_PEER_PREFIX) + 32 or not raw.startswith(_ED25519_PEER_PREFIX):
        raise UserError(f"peer id {clip(peer_id, 80)} does not embed an Ed25519 public key")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PEER_PREFIX):])


def verify_peer_signature(peer_id, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made by the key behind ``peer_id``."""
    try:
        peer_public_key(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, SwarmError, ValueError, TypeError):
        return False
