"""``/p2pswarm/token/1.0.0``: a peer shows the relay its node token before it reserves.

One framed msgpack request ``{"token": str, "scope": "relay"}``, one reply ``{"ok": bool,
"error": str, "expires": int}``, then the stream closes. The relay checks the token against the
peer id Noise authenticated for the connection (not anything the request says), so only the
holder can use it. The relay remembers the grant until the token expires; a reservation or a
circuit from a peer without a live grant is refused.
"""
from __future__ import annotations

import msgpack
import trio

from p2pswarm.errors import UserError, clip
from p2pswarm.net.wire.framing import FrameReader, send_frame

PROTOCOL_TOKEN = "/p2pswarm/token/1.0.0"
MAX_TOKEN_FRAME = 16 << 10
TOKEN_TIMEOUT_S = 10.0


class RelayRefused(UserError):
    """The relay said no (bad token, no reservation slot): retrying the same thing will not help."""


async def present_token(net, relay, token: str, *, scope: str = "relay", timeout_s: float = TOKEN_TIMEOUT_S) -> int:
    """Show ``token`` to ``relay`` (a peer address or id); returns the grant's expiry (unix s).
    :class:`RelayRefused` with the relay's reason when it refuses; NetError when unreachable."""
    stream = await net.open_stream(relay, PROTOCOL_TOKEN, timeout_s=timeout_s)
    try:
        with trio.fail_after(timeout_s):
            await send_frame(stream, msgpack.packb({"token": token, "scope": scope}), MAX_TOKEN_FRAME)
            payload = await FrameReader(stream, MAX_TOKEN_FRAME).read_frame()
    except trio.TooSlowError:
        raise UserError(f"relay did not answer our token within {timeout_s:.0f} s") from None
    finally:
        await trio.aclose_forcefully(stream)
    if payload is None:
        raise UserError("relay closed the token stream without an answer")
    try:
        reply = msgpack.unpackb(payload, raw=False)
    except Exception:
        raise UserError("relay sent a malformed token reply") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        reason = reply.get("error") if isinstance(reply, dict) else None
        raise RelayRefused(f"relay refused our token: {clip(reason or 'no reason given', 300)}")
    return int(reply.get("expires") or 0)
