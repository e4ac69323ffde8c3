"""A NATed node's side of the relay: keep a reservation, forever.

:class:`RelayKeeper` dials the relay (over WebSocket: the only way out of a network that passes
80/443 alone), shows our node token, reserves, and then keeps the reservation: renewed well
before it expires, and re-established by itself - with back-off, indefinitely - when the relay
restarts or the network drops. While it holds a reservation our advertised address is
``<relay addr>/p2p/<relay id>/p2p-circuit`` (:meth:`NetHost.set_relay_addrs`); after a
re-reservation ``on_reserved`` runs so the node can re-join the DHT and re-publish its record
(a restarted relay has forgotten the records it stored).

We speak RESERVE ourselves (a dozen lines) rather than through py-libp2p's
``CircuitV2Transport.reserve``: the library's refresher gives up on a relay after one failed
refresh, never reconnects, and reports a refusal only as ``False``, which would leave a worker
silently unreachable.
"""
from __future__ import annotations

import logging
import random
import time

import trio
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from p2pswarm.errors import UserError
from p2pswarm.net.host import _reason, circuit_addr, parse_peer_addr
from relay.protocol import RelayRefused, present_token

log = logging.getLogger("p2pswarm.relay")

RESERVE_TIMEOUT_S = 15.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
REFUSED_RETRY_S = 60.0
WATCH_S = 0.5  # how often we check that the relay connection is still there


def _status_name(code: int) -> str:
    try:
        return StatusCode(code).name.lower().replace("_", " ")
    except ValueError:
        return f"status {code}"


class RelayKeeper:
    def __init__(self, net, relay_addr: str, token: str | None, *, on_reserved=None, relay_only: bool = True):
        info = parse_peer_addr(relay_addr)
        if "p2p-circuit" in relay_addr:
            raise UserError(f"--relay {relay_addr[:80]!r} is itself a relayed address: give the relay's own address")
        self.net = net
        self.relay_addr = relay_addr
        self.relay_id = info.peer_id
        self.token = token
        self.on_reserved = on_reserved
        self.relay_only = relay_only
        self.circuit = circuit_addr(relay_addr)
        self.expires = 0
        self.reservations = 0
        self.reconnects = 0

    async def reserve_once(self) -> int:
        """Connect, show the token, RESERVE; returns the reservation's expiry (unix s)."""
        await self.net.connect(self.relay_addr, timeout_s=RESERVE_TIMEOUT_S)
        if self.token:
            await present_token(self.net, self.relay_addr, self.token)
        with trio.fail_after(RESERVE_TIMEOUT_S):
            stream = await self.net.host.new_stream(self.relay_id, [HOP_PROTOCOL])
            try:
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                resp = await read_delimited_msg(stream, HopMessage)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await stream.close()
                    except Exception:
                        pass
        status = resp.status if resp.HasField("status") else StatusCode.OK
        if status != StatusCode.OK:
            hint = " (no token presented: give --token)" if status == StatusCode.PERMISSION_DENIED and not self.token else ""
            raise RelayRefused(f"relay refused the reservation: {_status_name(status)}{hint}")
        expire = int(resp.reservation.expire) if resp.HasField("reservation") else int(time.time()) + 60
        self.expires = expire
        self.reservations += 1
        self.net.set_relay_addrs([self.circuit], relay_only=self.relay_only)
        return expire

    def connected(self) -> bool:
        """A live connection to the relay (py-libp2p can keep a dead one registered a while)."""
        conns = self.net.host.get_network().connections.get(self.relay_id) or []
        return any(not getattr(c, "is_closed", False) for c in conns)

    async def start(self) -> str:
        """Reserve now; a refusal or an unreachable relay is a one-line error. Returns our
        relayed address."""
        try:
            exp = await self.reserve_once()
        except trio.TooSlowError:
            raise UserError(f"relay {self.relay_addr} did not answer within {RESERVE_TIMEOUT_S:.0f} s") from None
        log.info("reserved a slot on relay %s until %s; reachable at %s/p2p/%s", self.relay_id.to_base58(),
                 time.strftime("%H:%M:%S UTC", time.gmtime(exp)), self.circuit, self.net.peer_id_str)
        return self.circuit

    async def keep(self) -> None:
        """Hold the reservation until cancelled: renew it, re-establish it when lost."""
        while True:
            await self._hold()
            await self._reestablish()

    async def _hold(self) -> None:
        """Return when the reservation must be redone: connection lost, or renewal failed."""
        while True:
            ttl = max(0.0, self.expires - time.time())
            renew_at = time.monotonic() + max(1.0, min(ttl / 2, ttl - 30))
            while time.monotonic() < renew_at:
                if not self.connected():
                    log.warning("lost the connection to relay %s: reconnecting", self.relay_id.to_base58())
                    return
                await trio.sleep(WATCH_S)
            try:
                self.expires = await self.reserve_once()
                log.debug("renewed the relay reservation until %s", self.expires)
            except (UserError, trio.TooSlowError, Exception) as exc:
                log.warning("renewing the relay reservation failed: %s", _reason(exc))
                return

    async def _reestablish(self) -> None:
        t0 = time.monotonic()
        delay = BACKOFF_MIN_S
        attempt = 0
        while True:
            attempt += 1
            await self.net.forget_dead_connections(self.relay_id)
            try:
                exp = await self.reserve_once()
                break
            except RelayRefused as exc:  # e.g. our token expired: only a new token helps; ask rarely
                log.warning("attempt %d: %s; retrying in %.0f s", attempt, exc, REFUSED_RETRY_S)
                await trio.sleep(REFUSED_RETRY_S)
                continue
            except (UserError, trio.TooSlowError, Exception) as exc:
                log.info("attempt %d to reach relay %s failed: %s; retrying in %.1f s", attempt,
                         self.relay_id.to_base58(), _reason(exc), delay)
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(BACKOFF_MAX_S, delay * 2)
        self.reconnects += 1
        log.info("re-reserved on relay %s after %.1f s (%d attempts), until %s", self.relay_id.to_base58(),
                 time.monotonic() - t0, attempt, time.strftime("%H:%M:%S UTC", time.gmtime(exp)))
        if self.on_reserved is not None:
            try:
                await self.on_reserved()
            except (UserError, Exception) as exc:
                log.warning("after re-reserving: %s", _reason(exc))
