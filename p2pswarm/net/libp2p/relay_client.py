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
from collections.abc import Awaitable, Callable, Sequence

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from p2pswarm.errors import UserError, clip
from p2pswarm.net.libp2p.addrs import circuit_addr, error_reason, parse_peer_addr
from p2pswarm.net.libp2p.relay_token import RelayRefused, present_token

log = logging.getLogger("p2pswarm.relay")

RESERVE_TIMEOUT_S = 15.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
REFUSED_RETRY_S = 60.0
WATCH_S = 0.5  # how often we check that the relay connection is still there
MOVE_AFTER = 2  # failed attempts on a lost relay before trying the others
LEARN_S = 60.0  # how often a keeper refreshes the list of other relays from the DHT


def _status_name(code: int) -> str:
    try:
        return StatusCode(code).name.lower().replace("_", " ")
    except ValueError:
        return f"status {code}"


class RelayKeeper:
    """Holds a reservation on one relay out of ``relays`` (one address or several), moving to
    another when its relay dies, is full or refuses us. ``discover()``, when given, returns more
    candidates (relays found in the DHT, :func:`p2pswarm.net.libp2p.relay_discovery.find_relays`): asked when no given
    relay works, and when the current one is lost."""

    def __init__(self, net, relays: str | Sequence[str], token: str | None, *, on_reserved=None,
                 relay_only: bool = True, discover: Callable[[set[str]], Awaitable[list[str]]] | None = None):
        given = [relays] if isinstance(relays, str) else list(relays)
        for addr in given:
            if "p2p-circuit" in addr:
                raise UserError(f"--relay {clip(addr, 200)!r} is itself a relayed address: give the relay's own address")
            parse_peer_addr(addr)
        if not given and discover is None:
            raise UserError("a relayed node needs a relay address (--relay) or a DHT to find relays in")
        self.net = net
        self.given = given
        self.discover = discover
        self.token = token
        self.on_reserved = on_reserved
        self.relay_only = relay_only
        self.relay_addr: str | None = None  # the relay we use now, its id, our circuit address there
        self.relay_id: ID | None = None
        self.circuit: str | None = None
        if given:
            self._use(given[0])
        self.expires = 0
        self.reservations = 0
        self.reconnects = 0
        self.moves = 0
        self.known: list[str] = []  # other relays seen in the DHT (see learn_relays)
        self._learnt = time.monotonic()

    def _use(self, addr: str) -> str:
        """Make ``addr`` the relay we use; returns our circuit address through it."""
        self.relay_addr = addr
        self.relay_id = parse_peer_addr(addr).peer_id
        self.circuit = circuit = circuit_addr(addr)
        return circuit

    def _short(self) -> str:
        return self.relay_id.to_base58() if self.relay_id is not None else "(none)"

    async def _candidates(self, exclude: set[str]) -> list[str]:
        """Given relays first (in random order, so workers spread), then discovered ones."""
        given = [a for a in self.given if parse_peer_addr(a).peer_id.to_base58() not in exclude]
        random.shuffle(given)
        found = []
        if self.discover is not None:
            found = await self.discover(exclude)
            if found:
                self.known = found
            else:  # the DHT may have gone with our relay: the relays we learnt while it was up
                found = [a for a in self.known if parse_peer_addr(a).peer_id.to_base58() not in exclude]
        seen = {parse_peer_addr(a).peer_id.to_base58() for a in given}
        return given + [a for a in found if parse_peer_addr(a).peer_id.to_base58() not in seen]

    async def learn_relays(self) -> None:
        """Remember the other relays the DHT knows now, for when ours and its DHT links are gone."""
        if self.discover is not None and self.relay_id is not None:
            found = await self.discover({self.relay_id.to_base58()})
            self._learnt = time.monotonic()
            if found:
                self.known = found
                log.debug("%d other relays known: %s", len(found), ", ".join(found))

    async def reserve_once(self) -> int:
        """Connect to the current relay, show the token, RESERVE; returns the reservation's expiry."""
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
        """Reserve now on the first relay that takes us (given ones in random order, then discovered
        ones); none does: a one-line error with each one's reason. Returns our relayed address."""
        failures: list[tuple[str, BaseException]] = []
        for addr in await self._candidates(set()):
            circuit = self._use(addr)
            try:
                exp = await self.reserve_once()
            except trio.TooSlowError:
                failures.append((self._short(), UserError(
                    f"relay {clip(addr, 200)} did not answer within {RESERVE_TIMEOUT_S:.0f} s")))
                continue
            except (UserError, Exception) as exc:
                failures.append((self._short(), exc))
                log.info("relay %s did not take us: %s", self._short(), error_reason(exc)[:160])
                continue
            log.info("reserved a slot on relay %s until %s; reachable at %s/p2p/%s", self._short(),
                     time.strftime("%H:%M:%S UTC", time.gmtime(exp)), circuit, self.net.peer_id_str)
            return circuit
        if not failures:
            raise UserError("no relay to reserve on: none given and none found in the DHT")
        if len(failures) == 1:
            raise failures[0][1]
        raise UserError(f"no relay took us ({len(failures)} tried): "
                        + "; ".join(f"{pid}: {error_reason(exc)[:120]}" for pid, exc in failures))

    async def keep(self) -> None:
        """Hold the reservation until cancelled: renew it, re-establish it when lost."""
        while True:
            await self.learn_relays()
            await self._hold()
            await self._reestablish()

    async def _hold(self) -> None:
        """Return when the reservation must be redone: connection lost, or renewal failed."""
        while True:
            ttl = max(0.0, self.expires - time.time())
            renew_at = time.monotonic() + max(1.0, min(ttl / 2, ttl - 30))
            while time.monotonic() < renew_at:
                if time.monotonic() - self._learnt > LEARN_S:
                    await self.learn_relays()
                if not self.connected():
                    log.warning("lost the connection to relay %s: reconnecting", self._short())
                    return
                await trio.sleep(WATCH_S)
            try:
                self.expires = await self.reserve_once()
                log.debug("renewed the relay reservation until %s", self.expires)
            except (UserError, trio.TooSlowError, Exception) as exc:
                log.warning("renewing the relay reservation failed: %s", error_reason(exc))
                return

    async def _reestablish(self) -> None:
        """Get a reservation back: the same relay first; after :data:`MOVE_AFTER` failed attempts (or
        a refusal) every other candidate once per round, moving to the first that takes us."""
        t0 = time.monotonic()
        delay = BACKOFF_MIN_S
        attempt = 0
        lost = self.relay_id
        while True:
            attempt += 1
            await self.net.forget_dead_connections(self.relay_id)
            try:
                exp = await self.reserve_once()
                break
            except RelayRefused as exc:  # e.g. full, or our token expired there
                log.warning("attempt %d: %s", attempt, exc)
                refused = True
            except (UserError, trio.TooSlowError, Exception) as exc:
                log.info("attempt %d to reach relay %s failed: %s", attempt, self._short(), error_reason(exc)[:160])
                refused = False
            if (refused or attempt >= MOVE_AFTER) and (exp := await self._move(
                    exclude=set() if lost is None else {lost.to_base58()})):
                break
            # refused by every relay (e.g. our token expired): only a new token helps, ask rarely
            await trio.sleep((REFUSED_RETRY_S if refused else delay) * random.uniform(0.8, 1.2))
            delay = min(BACKOFF_MAX_S, delay * 2)
        self.reconnects += 1
        log.info("re-reserved on relay %s after %.1f s (%d attempts), until %s", self._short(),
                 time.monotonic() - t0, attempt, time.strftime("%H:%M:%S UTC", time.gmtime(exp)))
        if self.on_reserved is not None:
            try:
                await self.on_reserved()
            except (UserError, Exception) as exc:
                log.warning("after re-reserving: %s", error_reason(exc))

    async def _move(self, exclude: set[str]) -> int:
        """Reserve on another relay; its expiry, or 0 when none took us (the current one is kept)."""
        current = self.relay_addr
        for addr in await self._candidates(exclude):
            self._use(addr)
            try:
                exp = await self.reserve_once()
            except (UserError, trio.TooSlowError, Exception) as exc:
                log.info("relay %s did not take us: %s", self._short(), error_reason(exc)[:160])
                continue
            self.moves += 1
            log.warning("moved to relay %s (the previous one is gone); reachable at %s/p2p/%s", self._short(),
                        self.circuit, self.net.peer_id_str)
            return exp
        if current is not None:
            self._use(current)
        return 0
