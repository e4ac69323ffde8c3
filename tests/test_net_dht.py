"""The swarm DHT on real libp2p hosts on 127.0.0.1, all in this trio process.

Shard advertisement and coverage resolution end to end, plus one regression test per py-libp2p
trap p2pswarm/net/dht/kademlia.py and p2pswarm/net/libp2p/kad_patches.py (patch_kad) code around (each ``test_workaround_*`` fails without its workaround).
"""
from __future__ import annotations

import hashlib
import time
from contextlib import asynccontextmanager

import multiaddr
import pytest
import trio
from libp2p.kad_dht.common import PROTOCOL_ID as LIB_PROTOCOL_ID

from p2pswarm.market.swarm_dht import open_dht
from p2pswarm.net.libp2p.kad_patches import KAD_PROTOCOL
from p2pswarm.net.libp2p.host import open_host
from p2pswarm.net.signed.identity import Identity
from p2pswarm.net.signed.records import NodeRecord, ShardEntry, node_record_key, units_for

from helpers.dht import MODEL, OTHER_MODEL, Node, advertiser, dht_swarm, resolver


def _key(i: int) -> bytes:
    return b"\x12\x20" + hashlib.sha256(b"test-key-%d" % i).digest()


# -- the py-libp2p traps --------------------------------------------------------------------------
async def test_workaround_kad_protocol_id_is_ours():
    async with dht_swarm(3) as nodes:
        for node in nodes:
            handlers = set(map(str, node.net.host.get_mux().handlers))
            assert str(KAD_PROTOCOL) in handlers and "/ipfs/kad/1.0.0" not in handlers
        assert str(LIB_PROTOCOL_ID) == "/ipfs/kad/1.0.0"  # the name bound at import: the library's own
        # and the library's outgoing queries use it too: a look-up through the others works
        await nodes[1].dht.provide(_key(0))
        found = await nodes[2].dht.find_providers(_key(0))
        assert [p.peer_id for p in found] == [nodes[1].net.peer_id]


async def test_workaround_provide_rate_limit_raised():
    """One node provides 40 units: all 40 must reach the server (py-libp2p drops all but 10)."""
    async with dht_swarm(2) as (server, worker):
        for i in range(40):
            assert await worker.dht.provide(_key(i))

        def stored() -> int:
            return sum(1 for i in range(40) if server.dht.kad.provider_store.get_providers(_key(i)))

        with trio.move_on_after(5):  # ADD_PROVIDER is fire-and-forget: let the last ones land
            while stored() < 40:
                await trio.sleep(0.05)
        assert stored() == 40


@pytest.mark.slow
async def test_workaround_more_than_20_providers_per_key():
    """24 clients provide one key (the model index): a look-up must list all 24 (py-libp2p's
    server keeps the first 20 and drops the rest)."""
    async with dht_swarm(1, clients=25) as nodes:
        providers, reader = nodes[1:-1], nodes[-1]
        async with trio.open_nursery() as nursery:
            for p in providers:
                nursery.start_soon(p.dht.provide, _key(7))
        found = {i.peer_id for i in await reader.dht.find_providers(_key(7), exhaustive=True)}
        assert found == {p.net.peer_id for p in providers}


async def test_providers_per_key_trap_still_present(monkeypatch):
    """Control: with the library's own limit back in place its provider store drops the 21st
    provider of a key, so the patch is still needed."""
    import libp2p.kad_dht.provider_store as store
    from libp2p.kad_dht.common import BUCKET_SIZE
    from libp2p.peer.peerinfo import PeerInfo

    monkeypatch.setattr(store, "BUCKET_SIZE", BUCKET_SIZE)
    async with open_host(Identity.generate()) as net:
        ps = store.ProviderStore(net.host)
        for _ in range(21):
            ps.add_provider(_key(3), PeerInfo(Identity.generate().peer_id, [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")]))
        assert len(ps.get_providers(_key(3))) == 20


@pytest.mark.slow
async def test_workaround_inbound_kad_stream_limit_raised():
    """Many look-ups at once against one server: none of its answers may be a reset."""
    async with dht_swarm(2, clients=1) as (server, provider, backbone):
        for i in range(4):
            await provider.dht.provide(_key(i))
        before = backbone.dht.stats.rpc_failures
        async with trio.open_nursery() as nursery:
            for i in range(48):
                nursery.start_soon(backbone.dht.find_providers, _key(i % 4))
        assert backbone.dht.stats.rpc_failures == before


@pytest.mark.slow
async def test_workaround_client_mode_peers_stay_out_of_routing_tables():
    async with dht_swarm(3, clients=2) as nodes:
        servers, clients = nodes[:3], nodes[3:]
        for c in clients:  # clients talk to the servers: each kad stream used to register the client
            await c.dht.find_providers(_key(1))
            await c.dht.get_values(node_record_key(servers[0].net.peer_id_str))
        with trio.fail_after(10):
            while sum(s.dht.stats.clients_kept_out for s in servers) < len(clients):
                await trio.sleep(0.05)
        client_ids = {c.net.peer_id for c in clients}
        for s in servers:
            assert not client_ids & set(s.dht.routing_peers())
            assert len(s.dht.routing_peers()) == 2  # the other servers are there
        # a look-up never hands a client out as a server to ask
        await servers[1].dht.provide(_key(2))
        assert [p.peer_id for p in await clients[0].dht.find_providers(_key(2))] == [servers[1].net.peer_id]


@pytest.mark.slow
async def test_workaround_node_records_are_never_read_from_a_stale_local_copy():
    # The reader is a client (a backbone behind NAT, swarm-status): no PUT ever reaches it, so
    # only its own look-ups can tell it that a record changed.
    async with dht_swarm(3, clients=1) as nodes:
        worker, reader = nodes[2], nodes[3]
        adv = advertiser(worker, [ShardEntry(MODEL, "s1", (0, 4), (0, 8))])
        await adv.publish()
        first = await reader.dht.get_node_record(worker.net.peer_id)
        assert first is not None and first.seq == adv.record.seq
        # py-libp2p's get_value stores what it read; from then on it answers from that copy
        assert await reader.dht.kad.get_value(node_record_key(worker.net.peer_id)) == first.signed
        await trio.sleep(0.01)
        await adv.publish()  # new seq (a restart would also bring a new address)
        assert adv.record.seq > first.seq
        again = await reader.dht.get_node_record(worker.net.peer_id)
        assert again.seq == adv.record.seq
        # the trap, still there: the library's get_value still returns the old copy
        assert await reader.dht.kad.get_value(node_record_key(worker.net.peer_id)) == first.signed


@asynccontextmanager
async def _fresh_node(boot: Node):
    """A DHT server whose routing table holds only the bootstrap (no self look-up yet)."""
    async with open_host(Identity.generate()) as net:
        async with open_dht(net) as dht:
            await trio.sleep(0.3)  # let py-libp2p's start-up table refresh pass while the table is empty
            await net.connect(boot.addr)
            await dht.kad.routing_table.add_peer(boot.net.peer_id, skip_server_mode_check=True)
            yield Node(net, dht)


@pytest.mark.slow
async def test_workaround_records_reach_the_closest_peers_even_from_a_fresh_node():
    """A node that knows only the bootstrap puts its record: it must reach the K closest peers."""
    async with dht_swarm(8) as nodes:
        def holders(node: Node) -> int:
            key = node_record_key(node.net.peer_id).encode()
            return sum(1 for n in nodes if n.dht.kad.value_store.get(key) is not None)

        # the trap: py-libp2p's put_value, whose FIND_NODE of the 67-byte key is refused
        async with _fresh_node(nodes[0]) as lib:
            assert len(lib.dht.routing_peers()) == 1
            rec = advertiser(lib, [ShardEntry(MODEL, "s", (0, 1), (0, 4))])._record()
            await lib.dht.kad.put_value(node_record_key(lib.net.peer_id), rec.signed)
        async with _fresh_node(nodes[0]) as ours:
            assert len(ours.dht.routing_peers()) == 1
            await advertiser(ours, [ShardEntry(MODEL, "s", (0, 1), (0, 4))]).publish()
        print(f"record holders (of 8) after a put from a fresh node: ours {holders(ours)}, "
              f"py-libp2p's put_value {holders(lib)}")
        assert holders(ours) == len(nodes)
        assert holders(lib) < len(nodes)


@pytest.mark.slow
async def test_workaround_dead_connections_forgotten_and_redialled():
    """Fresh nodes put their records into a swarm, six times over: every put must reach every
    server. Guards the write shield (a look-up cancelling its in-flight queries used to kill
    about one fresh connection in 30) and the retry after a dead connection (statistical:
    without them this test fails in most runs, not all)."""
    async with dht_swarm(8) as nodes:
        for _ in range(6):
            async with _fresh_node(nodes[0]) as fresh:
                key = node_record_key(fresh.net.peer_id)
                await fresh.dht.put_value(key, advertiser(fresh, [ShardEntry(MODEL, "s", (0, 1), (0, 4))])
                                          ._record().signed)
                assert all(n.dht.kad.value_store.get(key.encode()) is not None for n in nodes)


@pytest.mark.slow
async def test_workaround_lookups_deduplicated():
    async with dht_swarm(6, clients=1) as nodes:
        p1, p2, client = nodes[1], nodes[2], nodes[-1]
        for p in (p1, p2):
            await p.dht.provide(_key(7))
        ours = await client.dht.find_providers(_key(7))
        assert sorted(str(p.peer_id) for p in ours) == sorted([str(p1.net.peer_id), str(p2.net.peer_id)])
        assert client.dht.stats.duplicates_dropped > 0  # several servers named the same providers
        # the trap: py-libp2p's own find_providers lists a provider once per server that named it
        raw = await client.dht.kad.find_providers(_key(7).hex())
        assert len(raw) > len({str(p.peer_id) for p in raw})


# -- advertisement and resolution ----------------------------------------------------------------
@pytest.mark.slow
async def test_twenty_nodes_every_units_owners_found():
    """20 DHT servers; 6 of them serve shards (every range twice, one range three times); a
    backbone (another server) and a client resolve the full map: exactly the right owners."""
    layers, n_expert, bs = 4, 16, 4
    async with dht_swarm(20, clients=1) as nodes:
        ranges = [(0, 8), (8, 16), (0, 8), (8, 16), (4, 12), (0, 16)]
        workers = nodes[10:16]
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            advs = []
            for node, (e0, e1) in zip(workers, ranges):
                adv = advertiser(node, [ShardEntry(MODEL, f"shard{e0}-{e1}", (0, layers), (e0, e1))], block_size=bs)
                advs.append(adv)
                nursery.start_soon(adv.publish)
        t_adv = time.perf_counter() - t0
        expect = {}
        for node, (e0, e1) in zip(workers, ranges):
            for u in units_for(MODEL, (0, layers), (e0, e1), bs):
                expect.setdefault(u, set()).add(node.net.peer_id_str)
        for looker in (nodes[3], nodes[-1]):
            res = resolver(looker, layers=layers, n_expert=n_expert, block_size=bs)
            t0 = time.perf_counter()
            cmap = await res.refresh()
            dt = time.perf_counter() - t0
            got = {u: {o.peer for o in owners} for u, owners in cmap.units.items()}
            diff = {str(u): (len(got.get(u, ())), len(expect.get(u, ()))) for u in set(got) | set(expect)
                    if got.get(u) != expect.get(u)}
            assert not diff, f"units with wrong owners (found, expected): {diff}; {res.stats}; {looker.dht.stats}"
            for owners in cmap.units.values():  # de-duplicated: each owner once per unit
                assert len(owners) == len({o.peer for o in owners})
            assert not cmap.missing()
            assert res.stats.bogus_records == 0 and looker.dht.stats.duplicates_dropped > 0
            # every (layer, expert) maps to exactly the workers whose range holds it
            for e in range(n_expert):
                want = {w.net.peer_id_str for w, (e0, e1) in zip(workers, ranges) if e0 <= e < e1}
                assert {o.peer for o in res.owners(2, e)} == want
            print(f"20 nodes: advertise 6 workers {t_adv:.2f} s; resolve {len(res.units)} units from "
                  f"{'client' if looker is nodes[-1] else 'server'} {dt:.2f} s "
                  f"({dt / len(res.units) * 1000:.0f} ms/unit at concurrency {res.concurrency}; "
                  f"{looker.dht.stats.rpcs} kad RPCs)")
        # single look-up latency
        t0 = time.perf_counter()
        for u in list(expect)[:8]:
            await nodes[-1].dht.find_providers(u.key())
        print(f"20 nodes: one unit look-up {(time.perf_counter() - t0) / 8 * 1000:.1f} ms")


@pytest.mark.slow
async def test_concurrent_index_resolution_matches_the_sequential_per_unit_one():
    """The default resolution (the model index: one model-key look-up, then every worker's record,
    all concurrent) must give exactly the map the sequential per-unit one gives (every unit looked
    up, one look-up at a time, as before the index): same owners and shards for every unit."""
    layers, n_expert, bs = 3, 16, 4
    async with dht_swarm(8) as nodes:
        shards = [((0, 3), (0, 8)), ((0, 3), (4, 12)), ((0, 2), (8, 16)), ((1, 3), (0, 16))]
        workers = nodes[2:6]
        async with trio.open_nursery() as nursery:
            for node, (lr, er) in zip(workers, shards):
                adv = advertiser(node, [ShardEntry(MODEL, f"s{lr}{er}", lr, er)], block_size=bs)
                nursery.start_soon(adv.publish)
        fast = resolver(nodes[7], layers=layers, n_expert=n_expert, block_size=bs)
        slow = resolver(nodes[6], layers=layers, n_expert=n_expert, block_size=bs, concurrency=1)
        await fast.refresh()
        await slow.refresh(slow.units)

        def owners(res) -> dict:
            return {u: sorted((o.peer, o.shard.shard) for o in found) for u, found in res.map.units.items()}

        assert owners(fast) == owners(slow)
        assert fast.map.replicas() == slow.map.replicas()
        assert all(owners(fast).values()) and not fast.map.missing()
        assert max(fast.map.replicas().values()) >= 2  # overlapping shards: a real multi-owner map
        # the index found everyone: no per-unit look-up was needed; the sequential one did all 12
        assert (fast.stats.model_lookups, fast.stats.lookups) == (1, 0), fast.stats
        assert (slow.stats.model_lookups, slow.stats.lookups) == (0, len(slow.units)), slow.stats
        assert fast.stats.records_fetched == len(workers)


@pytest.mark.slow
async def test_withdraw_on_clean_shutdown_and_expiry():
    async with dht_swarm(4) as nodes:
        a, b, backbone = nodes[1], nodes[2], nodes[3]
        shard = ShardEntry(MODEL, "s", (0, 4), (0, 16))
        adv_a = advertiser(a, [shard])
        adv_b = advertiser(b, [shard], ttl_s=4)
        await adv_a.publish()
        await adv_b.publish()
        res = resolver(backbone)
        await res.refresh()
        assert {o.peer for o in res.owners(0, 0)} == {a.net.peer_id_str, b.net.peer_id_str}
        assert await adv_a.withdraw()
        assert not a.dht.kad.provider_store.providing_keys  # the library stops re-providing too
        await res.refresh()
        assert {o.peer for o in res.owners(0, 0)} == {b.net.peer_id_str}
        assert res.stats.withdrawn >= 1
        await trio.sleep(4.5)  # b stops re-providing (a kill -9): its record expires
        await res.refresh()
        assert res.owners(0, 0) == [] and len(res.map.missing()) == 16


@pytest.mark.slow
async def test_reprovide_refreshes_the_record_before_it_expires():
    """The record (the liveness signal) is re-signed every third of its TTL; the provider records,
    48 h claims, are not re-sent with it (DHT load independent of the record's short TTL)."""
    async with dht_swarm(3) as nodes:
        worker, backbone = nodes[1], nodes[2]
        adv = advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 16))], ttl_s=3)
        async with trio.open_nursery() as nursery:
            assert await nursery.start(adv.run) == 16
            res = resolver(backbone)
            for _ in range(3):
                await trio.sleep(1.5)  # past the first record's expiry, the re-published one is live
                await res.refresh()
                assert len(res.owners(1, 5)) == 1
            assert adv.rounds >= 3 and adv.provide_rounds == 1
            assert worker.dht.stats.provides == 16 + 1  # the units and the model key, once
            nursery.cancel_scope.cancel()


def test_replicas_are_counted_per_expert():
    """Workers holding experts 0-5, 6-10 and 11-15 touch both 8-expert blocks twice, yet every
    expert has one copy: each unit is covered once. A replica of 0-5 does not change that (experts
    6-7 still have one); a second copy of 6-15 makes block 1 twice covered."""
    from p2pswarm.net.dht.coverage import CoverageMap, OwnerInfo
    from p2pswarm.net.signed.records import CoverageUnit

    def owner(e0: int, e1: int) -> OwnerInfo:
        ident = Identity.generate()
        shard = ShardEntry(MODEL, f"s{e0}", (0, 2), (e0, e1))
        rec = NodeRecord.make(ident, addrs=["/ip4/127.0.0.1/tcp/1"], protocol=1, kernel="numpy", block_size=8,
                              shards=[shard], ttl_s=60)
        return OwnerInfo(ident.peer_id_str, rec.addrs, shard, rec)

    def cmap(owners: list[OwnerInfo], n_expert: int = 16) -> CoverageMap:
        units = [CoverageUnit(MODEL, layer, b, 8) for layer in range(2) for b in range(-(-n_expert // 8))]
        return CoverageMap({u: [o for o in owners if o.shard.experts[0] < u.experts.stop
                                and u.experts.start < o.shard.experts[1]] for u in units}, n_expert=n_expert)

    three = [owner(0, 6), owner(6, 11), owner(11, 16)]
    assert set(cmap(three).replicas().values()) == {1} and not cmap(three).missing()
    assert set(cmap(three + [owner(0, 6)]).replicas().values()) == {1}
    got = cmap(three + [owner(6, 16)]).replicas()
    assert [got[u] for u in sorted(got)] == [1, 2, 1, 2]
    # an expert nobody holds makes its unit uncovered, however many peers touch it
    gap = cmap([owner(0, 6), owner(7, 16)])
    assert [gap.unit_replicas(u) for u in sorted(gap.units)] == [0, 1, 0, 1] and len(gap.missing()) == 2
    # only owners the caller counts as alive (swarm-status: those that answered its probe)
    dead = three[1].peer
    assert set(cmap(three).replicas(alive=lambda o: o.peer != dead).values()) == {0}
    # a partial last block (12 experts, blocks of 8) counts only the experts that exist
    assert cmap([owner(0, 12)], n_expert=12).replicas() == {u: 1 for u in cmap([], n_expert=12).units}


@pytest.mark.slow
async def test_forged_and_malformed_records_ignored_and_counted(caplog):
    async with dht_swarm(4) as nodes:
        server, honest, rogue, backbone = nodes
        await advertiser(honest, [ShardEntry(MODEL, "s", (0, 4), (0, 16))]).publish()
        key = node_record_key(honest.net.peer_id)
        # the rogue signs a record naming the honest peer, with its own address and a huge seq
        body = NodeRecord.make(rogue.net.identity, addrs=["/ip4/6.6.6.6/tcp/1"], protocol=1, kernel="numpy",
                               block_size=4, shards=[ShardEntry(MODEL, "s", (0, 4), (0, 16))], ttl_s=60,
                               seq=1 << 50).body()
        body["peer"] = honest.net.peer_id_str
        import msgpack

        from p2pswarm.net.signed.records import SIGNING_DOMAIN

        raw = msgpack.packb(body)
        forged = msgpack.packb({"body": raw, "sig": rogue.net.identity.sign(SIGNING_DOMAIN + raw)})
        # 1. honest DHT servers refuse to store it
        before = server.dht.validator.rejected
        from libp2p.records.record import make_signed_put_record

        record = make_signed_put_record(key.encode(), forged, rogue.net.host.get_private_key())
        await rogue.dht.kad.value_store._store_at_peer(server.net.peer_id, key.encode(), forged, record=record)
        with trio.move_on_after(5):
            while server.dht.validator.rejected == before:
                await trio.sleep(0.05)
        assert server.dht.validator.rejected == before + 1
        assert server.dht.kad.value_store.get(key.encode()).value != forged
        # 2. a malicious server stores and serves a forged, then a malformed copy anyway
        for bogus in (forged, b"\x93garbage"):
            rogue.dht.kad.value_store.put(key.encode(), bogus)
            res = resolver(backbone)
            await res.refresh()
            owners = res.owners(0, 0)
            assert [o.peer for o in owners] == [honest.net.peer_id_str]
            assert owners[0].addrs == tuple(honest.net.addrs())  # not the forger's address
            assert res.stats.bogus_records >= 1
        assert any("ignored a DHT record" in r.getMessage() for r in caplog.records)
        # 3. provider records whose node record does not list the unit (here: another model)
        await advertiser(rogue, [ShardEntry(OTHER_MODEL, "x", (0, 4), (0, 16))]).publish()
        for u in units_for(MODEL, (0, 1), (0, 4), 4):
            await rogue.dht.provide(u.key())
        # 4. a provider with no node record at all
        for u in units_for(MODEL, (0, 1), (0, 4), 4):
            await server.dht.provide(u.key())
        res = resolver(backbone)
        await res.refresh()
        assert [o.peer for o in res.owners(0, 0)] == [honest.net.peer_id_str]


async def test_bootstrap_errors_are_clear():
    from p2pswarm.errors import UserError

    async with open_host(Identity.generate()) as net:
        with pytest.raises(UserError, match="no bootstrap peer answered"):
            async with open_dht(net, bootstrap=[f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id_str}"],
                                bootstrap_timeout_s=5):
                pass


async def test_bootstrap_with_another_peer_id_says_so():
    """A bootstrap address whose /p2p/ part names another peer than the one listening there (a
    stale or mistyped address): the error names the id that answered and the address to use, not
    py-libp2p's 'handshake failed'."""
    from p2pswarm.errors import UserError

    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as boot, open_host(Identity.generate()) as net:
        real = boot.full_addrs()[0]
        wrong = real.rsplit("/p2p/", 1)[0] + f"/p2p/{Identity.generate().peer_id_str}"
        with pytest.raises(UserError) as err:
            async with open_dht(net, bootstrap=[wrong], bootstrap_timeout_s=5):
                pass
        msg = str(err.value)
        assert "has another peer id" in msg and boot.peer_id_str in msg, msg
        assert real.rsplit("/p2p/", 1)[0] in msg and "handshake" not in msg, msg


async def test_workaround_provide_sends_the_advertised_addresses_and_never_none(caplog):
    """py-libp2p acknowledges an ADD_PROVIDER with no addresses and drops it (the trap, shown on a
    raw message); our provide sends what the node advertises -- for a relayed node, its circuit
    address -- and provides nothing while it has no address at all."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Message

    key = b"\x12\x20" + hashlib.sha256(b"provider-addresses").digest()
    async with dht_swarm(2, clients=1) as nodes:
        server, relayed = nodes[0], nodes[2]
        # the trap: an address-less provider is acknowledged and not stored
        msg = Message()
        msg.type = Message.MessageType.ADD_PROVIDER
        msg.key = key
        msg.providerPeers.add().id = relayed.net.peer_id.to_bytes()
        resp = await relayed.dht._rpc(server.net.peer_id, msg)
        assert resp is not None and resp.type == Message.MessageType.ADD_PROVIDER
        assert not server.dht.kad.provider_store.get_providers(key)
        # a relay-only node without a reservation yet: nothing to advertise, so nothing provided
        relayed.net.relay_only = True
        assert relayed.net.addrs() == []
        with caplog.at_level("WARNING", logger="p2pswarm.net"):
            assert await relayed.dht.provide(key) == 0
        assert "no address to advertise" in caplog.text
        # with a reservation: the circuit address is what the network learns
        circuit = f"{server.net.full_addrs()[0]}/p2p-circuit"
        relayed.net.set_relay_addrs([circuit])
        assert await relayed.dht.provide(key) >= 1
        found = await nodes[1].dht.find_providers(key)
        assert [str(a) for p in found if p.peer_id == relayed.net.peer_id for a in p.addrs] == [circuit]
