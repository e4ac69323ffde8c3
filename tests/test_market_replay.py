"""The market's promise "outputs stay bit-equal to monolithic throughout": replay on ban. A worker falsifying 1%
of its rows is checked at a sample rate well below 1, so some of its wrong rows are used before it is
caught; every sequence still running at the catch is rewound to before the first position that used
its unverified outputs and recomputed, and ends bit-equal to the monolithic run. Real worker objects
on real shards (the liar is tests/helpers/dishonest_worker.py's subclass), the real scheduler, the
real HTTP app."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from p2pswarm.backbone.dispatch.dispatcher import Dispatcher, InProcessOwner
from p2pswarm.backbone.serving.generate import generate
from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.scheduler import Params, Rewind, Scheduler, SequenceRewound
from p2pswarm.backbone.sessions.local import ensure_shards, open_backbone
from p2pswarm.engine.kernels import make_bank
from p2pswarm.engine.text.tokenizer import Tokenizer
from p2pswarm.market.bans import BanKeeper, BanRecord
from p2pswarm.market.verify import Verifier
from p2pswarm.net.signed.identity import Identity
from p2pswarm.model.layout import ModelLayout
from p2pswarm.model.manifest import model_fingerprint
from p2pswarm.worker.expert_worker import ExpertWorker

from helpers.dishonest_worker import DishonestWorker
from p2pswarm.backbone.serving.generate import sequence_logits

RATE, FRACTION = 0.05, 0.01  # r p = 1 / 2,000 rows: the catch lands mid-run with these seeds
N, MAX_TOKENS = 12, 40
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + i % 9)] for i in range(N)]


def _sampler(i: int):
    return Sampler(0.9, 0.95, seed=i) if i % 4 == 3 else None  # a quarter sampled: the sampler is rewound too


def _lie(swarm, *, delta: float = 1.0, seed: int = 2, verify_seed: int = 1) -> DishonestWorker:
    """Make the swarm's second worker a liar and check a sample of every worker's rows."""
    layout = ModelLayout.open(swarm.backbone.model.layout.path)
    shards = ensure_shards(layout, model_fingerprint(layout), 2)
    liar = DishonestWorker(shards[1], kernel="numpy", fraction=FRACTION, delta=delta, seed=seed)
    disp = swarm.backbone.dispatcher
    disp.owners[1] = InProcessOwner(liar, "liar")
    disp.verifier = Verifier(RATE, seed=verify_seed)
    return liar


async def _run(backbone, *, short: bool = False):
    """All prompts at once through a scheduler; per request the final tokens and every Rewind
    with the tokens the request held when it came. ``short``: also one 2-token request that ends
    early and one that cannot take tokens back. Submitted in order before the step loop starts,
    so every run batches the same way (and the verifier samples the same rows)."""
    sched = Scheduler(backbone, token_budget=64, prefill_chunk=8, micro_batches=1)
    got, rewinds, extra = {}, {}, {}
    reqs = [sched.submit(PROMPTS[i], Params(max_tokens=MAX_TOKENS, sampler=_sampler(i)), rewinds=True)
            for i in range(N)]
    if short:
        short_req = sched.submit([5, 4, 3], Params(max_tokens=2))
        plain_req = sched.submit([9, 8, 7, 6], Params(max_tokens=MAX_TOKENS))

    async def one(i):
        toks, seen = [], []
        async with reqs[i] as req:
            async for step in req:
                if isinstance(step, Rewind):
                    seen.append((step, list(toks)))
                    del toks[step.keep:]
                else:
                    assert step.index == len(toks)
                    toks.append(step.token)
        got[i], rewinds[i] = toks, seen

    async def collect(name, req):
        try:
            async with req:
                extra[name] = [s.token async for s in req]
        except SequenceRewound as exc:
            extra[name] = exc

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as clients:
            for i in range(N):
                clients.start_soon(one, i)
            if short:
                clients.start_soon(collect, "short", short_req)
                clients.start_soon(collect, "plain", plain_req)
            await nursery.start(sched.run)
        nursery.cancel_scope.cancel()
    return got, rewinds, extra


@pytest.mark.slow
async def test_replay_on_ban_keeps_every_running_output_equal_to_monolithic(tiny_f32):
    async with open_backbone(tiny_f32, workers=0, kernel="numpy") as mono:
        want, _, _ = await _run(mono.backbone)
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        liar = _lie(swarm)
        got, rewinds, extra = await _run(swarm.backbone, short=True)
        disp, replays = swarm.backbone.dispatcher, swarm.backbone.replays
    assert disp.bans.banned.keys() == {"liar"} and disp.stats.mismatches == 1 and liar.falsified > 1
    # the catch came mid-run: requests had tokens that were withdrawn ...
    assert replays.sequences >= N and replays.tokens_withdrawn > 0 and replays.rows > 0
    assert all(rewinds[i] for i in range(N))
    # ... and some of those withdrawn tokens were wrong: the liar's unverified rows were used and
    # changed the output, so without the replay these requests would not equal monolithic
    wrong = [i for i in range(N) for rw, had in rewinds[i] if had[rw.keep:] != want[i][rw.keep:len(had)]]
    assert wrong, "the liar's rows never changed a token: this test would prove nothing"
    assert any(_sampler(i) is None for i in wrong) or len(wrong) > 1
    # every request running at the catch ends bit-equal (token for token) to monolithic
    for i in range(N):
        assert got[i] == want[i], i
    # one that finished before the catch cannot be fixed: counted; one that cannot take tokens back fails
    assert len(extra["short"]) == 2 and replays.finished_unfixable >= 1
    assert isinstance(extra["plain"], SequenceRewound) and "liar" in str(extra["plain"])
    # the same run with replay off: the same catch, and outputs that are not monolithic's
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        _lie(swarm)
        swarm.backbone.replay_on_ban = False
        off, rewinds_off, _ = await _run(swarm.backbone)
        assert swarm.backbone.dispatcher.bans.banned.keys() == {"liar"} and swarm.backbone.replays.sequences == 0
    assert not any(rewinds_off.values()) and any(off[i] != want[i] for i in range(N))


async def test_a_ban_while_idle_reports_the_finished_requests_it_spoiled(tiny_f32, caplog):
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        _lie(swarm)
        swarm.backbone.dispatcher.verifier = None
        sched = Scheduler(swarm.backbone)
        listeners = swarm.backbone.dispatcher.bans.listeners
        before = len(listeners)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            assert len(listeners) == before + 1  # the running loop listens for bans...
            async with sched.submit([5, 4, 3], Params(max_tokens=3, request_id="cmpl-early")) as req:
                assert len([s async for s in req]) == 3
            await trio.sleep(0.05)
            swarm.backbone.dispatcher.bans.ban("liar", "a ban record of another backbone")
            with trio.fail_after(10):
                while swarm.backbone.replays.finished_unfixable == 0:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert len(listeners) == before  # ...and a stopped one no longer does (schedulers come and go)
    assert swarm.backbone.replays.finished_unfixable == 1 and swarm.backbone.replays.sequences == 0
    assert "1 requests that finished before worker liar was banned" in caplog.text and "cmpl-early" in caplog.text


@pytest.mark.slow
async def test_logits_decode_replays_to_the_monolithic_bits(tiny_f32):
    """`p2pswarm logits --decode --swarm`'s path (Backbone.logits): rows from the first tainted
    position on are recomputed after the ban, so all of them equal the monolithic run's."""
    tokens = [(i * 37 + 11) % 500 for i in range(120)]
    async with open_backbone(tiny_f32, workers=0, kernel="numpy") as mono:
        want = await sequence_logits(mono.backbone, tokens, decode=True)
        want_prefill = await sequence_logits(mono.backbone, tokens)
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        _lie(swarm)
        swarm.backbone.dispatcher.verifier = None  # unchecked, the liar's rows change the result
        assert not np.array_equal(await sequence_logits(swarm.backbone, tokens, decode=True), want)
        liar = _lie(swarm, verify_seed=3)
        got = await sequence_logits(swarm.backbone, tokens, decode=True)
        assert swarm.backbone.dispatcher.bans.banned.keys() == {"liar"} and liar.falsified > 1
        assert swarm.backbone.replays.sequences == 1
        assert np.array_equal(got, want)
        # a prefill the ban lands in is recomputed whole (a fresh liar, caught in the call)
        swarm.backbone.dispatcher.bans.banned.clear()
        liar = _lie(swarm, verify_seed=5)
        liar.fraction = 0.2
        got = await sequence_logits(swarm.backbone, tokens)
        assert swarm.backbone.dispatcher.bans.banned and np.array_equal(got, want_prefill)


@pytest.mark.slow
async def test_generate_replays_to_the_monolithic_tokens(tiny_f32):
    """`p2pswarm generate`'s path (one sequence, no scheduler): a ban mid-run (an honoured ban
    record; nobody checks here) yields a Rewind, and the tokens that follow end equal to monolithic,
    sampled (the sampler restarts from its initial copy) as well as greedy."""
    tok = Tokenizer.from_gguf(tiny_f32)
    ids = tok.encode("the swarm serves many sequences at once")
    for temperature in (0.0, 0.8):
        async with open_backbone(tiny_f32, workers=0, kernel="numpy") as mono:
            want = [s.token async for s in generate(mono.backbone, tok, ids, max_tokens=30, stop_at_eos=False,
                                                    sampler=Sampler(temperature, 0.9, seed=7))]
        async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
            _lie(swarm)
            disp = swarm.backbone.dispatcher
            disp.verifier = None
            toks, rewinds = [], []
            async for step in generate(swarm.backbone, tok, ids, max_tokens=30, stop_at_eos=False,
                                       sampler=Sampler(temperature, 0.9, seed=7)):
                if isinstance(step, Rewind):
                    rewinds.append(step)
                    del toks[step.keep:]
                    continue
                toks.append(step.token)
                if len(toks) == 15 and not rewinds:
                    disp.bans.ban("liar", "a ban record of another backbone")
        assert [(r.keep, r.sent) for r in rewinds] == [(0, 15)] and swarm.backbone.replays.sequences == 1
        assert toks == want, temperature


async def test_dispatcher_reports_unverified_rows_only(tiny_f32, tmp_path):
    """The taint a step reports: every row a remote worker computed unchecked, none that were
    checked (rate 1) and none of a banned worker's (computed here instead)."""
    layout = ModelLayout.open(tiny_f32)
    shards = ensure_shards(layout, model_fingerprint(layout), 2, tmp_path)
    bank = make_bank(layout, "numpy")
    disp = Dispatcher(bank, [InProcessOwner(ExpertWorker(s, kernel="numpy"), f"w{i}") for i, s in enumerate(shards)])
    cur = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    groups = [(1, np.array([0, 3])), (9, np.array([1])), (12, np.array([3, 4]))]
    taint: dict = {}
    await disp.run_groups(0, cur, groups, taint)
    assert taint.keys() == {"w0", "w1"}
    assert taint["w0"].tolist() == [True, False, False, True, False]
    assert taint["w1"].tolist() == [False, True, False, True, True]
    disp.verifier = Verifier(1.0, seed=0)
    taint = {}
    await disp.run_groups(0, cur, groups, taint)
    assert taint == {}
    disp.verifier = None
    disp.bans.ban("w1", "test")
    assert disp.bans.epoch == 1
    taint = {}
    await disp.run_groups(0, cur, groups, taint)
    assert taint.keys() == {"w0"}


@pytest.mark.slow
async def test_http_non_streamed_completions_end_exact_and_a_rewound_stream_ends_with_an_error(tiny_f32):
    """Through /v1/completions with the scheduler (as `node --role backbone` serves): a liar no
    one checks (rate 0) is banned mid-run by a signed ban record of another backbone, honoured
    here. Every non-streamed text equals the monolithic one; a stream whose sent text is
    withdrawn ends with the in-band `replayed_after_ban` error; /health counts the replays."""
    tok = Tokenizer.from_gguf(tiny_f32)
    prompts = [f"request {i}: the swarm serves" + " many" * (i % 5) for i in range(8)]
    streamed = {0, 1}

    async def serve(swarm, ban_after=None):
        app = CompletionsApp(swarm.backbone, tok, "tiny", swarm.fingerprint, model_path=tiny_f32,
                             scheduler=Scheduler(swarm.backbone, tok, micro_batches=1))
        out: dict = {}
        async with trio.open_nursery() as nursery:
            [base] = (await nursery.start(serve_http, app, "127.0.0.1", 0))[:1]
            base = base.replace("0.0.0.0", "127.0.0.1")

            def call(i):
                body = {"prompt": prompts[i], "max_tokens": 32, "temperature": 0.7 if i % 3 == 2 else 0, "seed": i}
                if ban_after is not None and i in streamed:
                    with httpx.Client(base_url=base, timeout=120) as c:
                        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                            return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
                r = httpx.post(base + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            async def one(i):
                out[i] = await trio.to_thread.run_sync(call, i)

            async def ban_later():
                while app.scheduler.stats.generated < ban_after:
                    await trio.sleep(0.01)
                other = Identity.generate()  # another backbone, whose bans this one trusts
                rec = BanRecord.make(other, banned="liar", model=swarm.fingerprint, evidence="e" * 64,
                                     reason="layer 1 expert 9", voids_epoch=1, voids_from_seq=1)
                BanKeeper(Identity.generate(), swarm.fingerprint, swarm.backbone.dispatcher.bans,
                          trusted=[other.peer_id_str])._honour(rec)
                out["sent_at_ban"] = app.scheduler.stats.generated

            with trio.fail_after(300):
                async with trio.open_nursery() as clients:
                    for i in range(len(prompts)):
                        clients.start_soon(one, i)
                    if ban_after is not None:
                        clients.start_soon(ban_later)
                out["health"] = (await trio.to_thread.run_sync(lambda: httpx.get(base + "/health", timeout=30))).json()
                out["metrics"] = (await trio.to_thread.run_sync(lambda: httpx.get(base + "/metrics", timeout=30))).text
            nursery.cancel_scope.cancel()
        return out

    async with open_backbone(tiny_f32, workers=0, kernel="numpy") as mono:
        want = await serve(mono)
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        _lie(swarm)
        swarm.backbone.dispatcher.verifier = None  # nobody checks here: the ban comes from elsewhere
        got = await serve(swarm, ban_after=40)
    health = got["health"]
    assert health["banned_workers"] == 1, health
    r = health["replays"]
    assert r["sequences"] >= len(prompts) - 2 and r["tokens_withdrawn"] > 0 and r["finished_unfixable"] == 0, health
    fams = {f.name: f for f in text_string_to_metric_families(got["metrics"])}
    assert fams["p2pswarm_replayed_sequences"].samples[0].value == r["sequences"]
    assert fams["p2pswarm_withdrawn_tokens"].samples[0].value == r["tokens_withdrawn"]
    for i in range(len(prompts)):
        if i not in streamed:
            assert got[i] == want[i], i
    for i in streamed:
        assert got[i][-1]["error"]["code"] == "replayed_after_ban", got[i][-1]
