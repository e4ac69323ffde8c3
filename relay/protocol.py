"""``/p2pswarm/token/1.0.0``, the relay's token protocol: defined in :mod:`p2pswarm.net.relay_token`
(every host uses its client side for relayed dials, so it lives with the net layer and p2pswarm
never imports relay/); re-exported here for the relay service."""
from p2pswarm.net.relay_token import MAX_TOKEN_FRAME, PROTOCOL_TOKEN, TOKEN_TIMEOUT_S, RelayRefused, present_token

__all__ = ["MAX_TOKEN_FRAME", "PROTOCOL_TOKEN", "TOKEN_TIMEOUT_S", "RelayRefused", "present_token"]
