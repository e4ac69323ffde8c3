"""The coverage resolver on real libp2p hosts on 127.0.0.1, all in this trio process: which
providers become owners, which are refused and why, and how refreshes re-read what they know
(a look-up that fails is no evidence; a record stored out of the closest peers' reach is still
found)."""
from __future__ import annotations

import pytest
import trio

from p2pswarm.net.dht.advertiser import ShardAdvertiser
from p2pswarm.net.signed.records import ShardEntry, node_record_key

from helpers.dht import MODEL, advertiser, dht_swarm, resolver


@pytest.mark.slow
async def test_incompatible_builds_are_refused_once_with_the_reason(caplog):
    """Another kernel (found through the unit keys) and another block size (found only through the
    model key): neither is an owner, both are in ``refused`` with the reason, and each is logged
    once over several refreshes. Re-published with our kernel, the first becomes an owner."""
    import logging

    async with dht_swarm(4) as nodes:
        other_kernel, other_bs, backbone = nodes[1], nodes[2], nodes[3]
        shard = ShardEntry(MODEL, "s", (0, 4), (0, 16))
        adv = ShardAdvertiser(other_kernel.dht, other_kernel.net.identity, shards=[shard], protocol=1,
                              kernel="ggml-other", block_size=4)
        await adv.publish()
        await advertiser(other_bs, [shard], block_size=8).publish()
        res = resolver(backbone)
        with caplog.at_level(logging.WARNING, logger="p2pswarm.net"):
            for _ in range(3):
                await res.refresh()
        assert res.owners(0, 0) == [] and res.stats.mismatched >= 2 and res.stats.model_lookups == 3
        k, b = other_kernel.net.peer_id_str, other_bs.net.peer_id_str
        assert res.refused[k][0] == "kernel mismatch: worker computes with 'ggml-other', we with 'numpy'"
        assert res.refused[b][0].startswith("block size mismatch: worker provides units of 8 experts, we look up "
                                            "units of 4")
        for peer, why in ((k, "kernel mismatch"), (b, "block size mismatch")):
            lines = [r.getMessage() for r in caplog.records if f"refused worker {peer}" in r.getMessage()]
            assert len(lines) == 1 and why in lines[0], lines
        adv.kernel = "numpy"
        await adv.publish_record()
        await res.refresh()
        assert [o.peer for o in res.owners(0, 0)] == [k] and k not in res.refused


@pytest.mark.slow
async def test_resolver_refreshes_on_request():
    async with dht_swarm(3) as nodes:
        worker, backbone = nodes[1], nodes[2]
        res = resolver(backbone, refresh_s=3600)
        async with trio.open_nursery() as nursery:
            await nursery.start(res.run)
            assert res.owners(0, 0) == []
            await advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 16))]).publish()
            res.request_refresh(worker.net.peer_id_str)  # e.g. after a failure
            with trio.fail_after(20):
                while not res.owners(0, 0):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_record_held_only_beyond_the_closest_peers_is_found():
    """A record stored before closer peers joined sits outside the three closest peers a look-up
    converges on: a read that found nothing there asks on to the K closest (a live worker's record
    was once "none found" at a backbone's first refresh, and the worker was never used)."""
    from libp2p.kad_dht.utils import sort_peer_ids_by_distance

    async with dht_swarm(6) as nodes:
        worker, reader = nodes[1], nodes[2]
        adv = advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 16))])
        key = node_record_key(worker.net.peer_id_str)
        others = [n for n in nodes if n is not worker and n is not reader]
        far = sort_peer_ids_by_distance(key.encode(), [n.net.host.get_id() for n in others])[-1]
        # stored at the farthest peer only (as if it was the one peer the worker knew at the time)
        assert await worker.dht.kad.value_store._store_at_peer(far, key.encode(), adv._record().signed)
        rec = await reader.dht.get_node_record(worker.net.peer_id_str)
        assert rec is not None and rec.peer == worker.net.peer_id_str
        assert await reader.dht.get_node_record(reader.net.peer_id_str) is None  # none anywhere: still None


@pytest.mark.slow
async def test_a_failed_owner_whose_record_read_fails_is_kept(monkeypatch):
    """A record read that fails is no evidence, for an owner that just failed too: its record is
    still in the DHT until it expires. One suite run showed it: a backbone stalled for a few seconds
    blamed two live workers (their deadlines ran out during its own stall), the refresh they asked
    for read no record for either (its look-ups timed out the same way), and both were dropped from
    the coverage map until a later refresh found them again."""
    from p2pswarm.net.dht.kademlia import SwarmDHT

    async with dht_swarm(3) as nodes:
        worker, backbone = nodes[1], nodes[2]
        await advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 16))]).publish()
        res = resolver(backbone)
        await res.refresh()
        peer = worker.net.peer_id_str
        assert [o.peer for o in res.owners(0, 0)] == [peer]
        real, reads = SwarmDHT.get_node_record, []

        async def fails_once(self, p, **kw):
            reads.append(p)
            return None if len(reads) == 1 else await real(self, p, **kw)

        monkeypatch.setattr(SwarmDHT, "get_node_record", fails_once)
        res.request_refresh(peer)  # the owner failed a request
        await res.refresh()
        assert reads == [peer] and [o.peer for o in res.owners(0, 0)] == [peer] and peer not in res.gone
        await res.refresh()  # read again, and found
        assert len(reads) == 2 and [o.peer for o in res.owners(0, 0)] == [peer]


@pytest.mark.slow
async def test_periodic_refresh_reuses_known_records_and_looks_up_a_rotating_part():
    """A refresh finds workers through the model index, re-reads each known owner's record (one
    look-up per peer, which covers all its units) and looks up only the uncovered units and (after
    the first) a rotating quarter of the rest; a change in a known owner's record shows in every unit at once."""
    async with dht_swarm(3) as nodes:
        worker, backbone = nodes[1], nodes[2]
        adv = advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 8))])
        await adv.publish()
        res = resolver(backbone)  # 4 layers x 4 blocks of 4 = 16 units; the worker covers 8
        await res.refresh()
        # the model index found the worker; only the 8 units it leaves uncovered were looked up
        assert res.stats.model_lookups == 1 and res.stats.lookups == 8 and len(res.map.missing()) == 8
        before, missing = res.stats.lookups, set(res.map.missing())
        await res.refresh()
        # the uncovered units + this round's quarter of all units (every 4th, from the 2nd)
        expect = missing | {u for i, u in enumerate(res.units) if i % 4 == 1}
        assert res.stats.lookups - before == len(expect) == 12, res.stats
        # the worker now serves all 16 experts, but provides no new unit: its record alone tells
        adv.shards = (ShardEntry(MODEL, "s2", (0, 4), (0, 16)),)
        rec = adv._record()
        await worker.dht.put_value(node_record_key(worker.net.peer_id_str), rec.signed)
        await res.refresh()
        assert not res.map.missing()
        assert [o.shard.shard for o in res.owners(3, 15)] == ["s2"]
        # a full sweep every `rotation` refreshes: over 4 periodic refreshes every unit was looked up
        before = res.stats.lookups
        for _ in range(res.rotation):
            await res.refresh()
        assert res.stats.lookups - before == 16


@pytest.mark.slow
async def test_an_owner_that_answers_us_outlives_its_expired_record_until_it_stops():
    """A worker whose re-published records do not reach us (behind a NAT, out only through a relay,
    under load) is kept while the owner table vouches that it answered within its record's lifetime;
    not once it stops answering, and never past a withdrawal. (Processes and a real NAT:
    tests/test_natted_worker_stays.py.)"""
    async with dht_swarm(3) as nodes:
        worker, backbone = nodes[1], nodes[2]
        adv = advertiser(worker, [ShardEntry(MODEL, "s", (0, 4), (0, 16))], ttl_s=3)
        await adv.publish()
        res = resolver(backbone)
        answered: dict[str, float] = {}
        res.vouch = lambda p, seconds: answered.get(p, float("inf")) <= seconds  # (seconds ago)
        await res.refresh()
        peer = worker.net.peer_id_str
        assert [o.peer for o in res.owners(0, 0)] == [peer]
        await trio.sleep(3.5)  # its record expires everywhere; no newer one is put
        answered[peer] = 1.0  # it answered a second ago
        await res.refresh()
        assert [o.peer for o in res.owners(0, 0)] == [peer] and res.stats.vouched == 1 and peer not in res.gone
        answered[peer] = 10.0  # silent for longer than its record lived (3 s): dropped
        await res.refresh()
        assert res.owners(0, 0) == [] and res.gone[peer].startswith("record expired")
        await adv.publish()  # back, and answering; then it leaves cleanly
        answered[peer] = 0.0
        await res.refresh()
        assert [o.peer for o in res.owners(0, 0)] == [peer]
        assert await adv.withdraw()
        await res.refresh()
        assert res.owners(0, 0) == [] and res.gone[peer].startswith("withdrawn")
