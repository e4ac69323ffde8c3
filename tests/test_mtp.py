"""The model's own MTP (NextN) block as the speculative drafter (issue 43, item 5): glm4moe,
qwen35moe and deepseek2.

The block's draft logits equal llama.cpp's own MTP context (``LLAMA_CONTEXT_TYPE_MTP``) within
1e-4 + 2e-5 * max|logit| on an F32 model, for a prefill of positions and two chained drafts; with
``--speculate mtp`` greedy tokens and every position's logits, and seeded texts, are the same as
without speculation, and drafts are accepted on a model whose block agrees with its trunk
(``make-model --mtp-agreement``), monolithic and through 3 worker processes; rejected drafts leave
deepseek2's MLA caches (the trunk's and the block's) as never drafting; the block's experts go to
the workers that own them where the backbone holds none (``--expert-cache none``)."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.owners.expert_cache import parse_cache_size
from p2pswarm.backbone.serving.mtp import MtpBlock, MtpState, block_for
from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.backbone.serving.speculation import Speculation
from p2pswarm.engine.experts.numpy_bank import ExpertBank
from p2pswarm.model.synth import make_model

from conftest import assert_one_line_error, run_cli
from helpers.gguf_edit import rewrite
from helpers.speculating import PROMPT, REPEATING, FreeDrafts
from helpers.speculating import run_spec as _run


ARCHS = ["glm4moe", "qwen35moe", "deepseek2"]


def _mtp_model(models_dir, arch: str, kind: str):
    """The tiny preset of ``arch`` with its MTP block, made once per session: ``f32`` (seed 45, for
    the comparison with llama.cpp) or ``agree`` (Q8_0, seed 46, ``--mtp-agreement 0.9``: drafts
    accepted often, not always)."""
    path = models_dir / f"mtp-{arch}-{kind}.gguf"
    if not path.exists():
        if kind == "f32":
            make_model(path, arch=arch, preset="tiny", qtype="f32", seed=45, **({} if arch == "glm4moe" else {"n_nextn": 1}))
        else:
            make_model(path, arch=arch, preset="tiny", qtype="q8_0", seed=46, mtp_agreement=0.9)
    return path


@pytest.fixture(params=ARCHS)
def f32_model(request, models_dir):
    return _mtp_model(models_dir, request.param, "f32")


@pytest.fixture(params=ARCHS)
def agreeing_model(request, models_dir):
    return _mtp_model(models_dir, request.param, "agree")


@pytest.fixture
def glm_f32(models_dir):
    return _mtp_model(models_dir, "glm4moe", "f32")


@pytest.fixture
def ds2_f32(models_dir):
    return _mtp_model(models_dir, "deepseek2", "f32")


@pytest.fixture
def ds2_agreeing(models_dir):
    return _mtp_model(models_dir, "deepseek2", "agree")


def _q35(models_dir):
    """The tiny qwen35moe preset at 3 layers (no MTP block: the refusal test adds its key)."""
    path = models_dir / "q35-mtp-trunk.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", seed=21, layers=3)
    return path


def _ds2(models_dir):
    """The tiny deepseek2 preset (no MTP block: the refusal test adds its key)."""
    path = models_dir / "ds2-mtp-trunk.gguf"
    if not path.exists():
        make_model(path, arch="deepseek2", preset="tiny", seed=22)
    return path


def _close(got, ref, what):
    tol = 1e-4 + 2e-5 * float(np.abs(ref).max())
    err = float(np.abs(np.asarray(got, np.float64) - ref).max())
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


async def test_draft_logits_match_llama_cpp_mtp_context(f32_model):
    """Trunk hidden states (after the final norm), the block's logits over a prompt's positions,
    and two chained drafts (each fed the previous draft and the block's own normed output), against
    llama.cpp's MTP graph on the same file."""
    from helpers.llama_ref import llama_mtp

    prompt = PROMPT
    async with open_backbone(f32_model, workers=0) as swarm:
        bb = swarm.backbone
        bb.keep_hidden = True
        state = bb.new_state()
        logits = await bb.forward(prompt, state)
    nxt = int(np.argmax(logits[-1]))
    follow = prompt[1:] + [nxt]
    block = MtpBlock(bb.model, ExpertBank(bb.model.layout))
    trunk = block.trunk_hidden(state.hidden.take(0, len(prompt)))
    st = MtpState(bb.model)
    ours, h = block.forward(st, follow, trunk)
    chain, rows = [], [ours]
    for _ in range(2):
        d = int(np.argmax(rows[-1][-1]))
        chain.append((d, h[-1]))
        lg, h = block.forward(st, [d], h[-1:])
        rows.append(lg)
    ref_trunk, ref = llama_mtp(f32_model, prompt, follow, chain)
    _close(trunk, ref_trunk, "trunk hidden state (h_nextn)")
    ours_all = np.concatenate(rows)
    assert ours_all.shape == ref.shape == (len(prompt) + 2, bb.model.n_vocab)
    for i in range(len(ours_all)):
        _close(ours_all[i], ref[i], f"MTP logits, row {i}")
    assert np.array_equal(np.argmax(ours_all, axis=1), np.argmax(ref, axis=1))
    # last_only (what MtpBlock.draft runs): every row through the attention, only the last one on
    # through the MoE and the head; the cache must then hold every row (the chained draft after
    # it reads them), and the last row's logits are llama.cpp's
    st1 = MtpState(bb.model)
    last, h1 = block.forward(st1, follow, trunk, last_only=True)
    assert last.shape == (1, bb.model.n_vocab) and h1.shape == (1, bb.model.n_embd)
    assert st1.fed == len(prompt)
    _close(last[0], ref[len(prompt) - 1], "MTP logits, the last row alone")
    d = int(np.argmax(last[0]))
    assert d == chain[0][0]
    nxt1, _ = block.forward(st1, [d], h1, last_only=True)
    _close(nxt1[0], ref[len(prompt)], "MTP logits, chained after a last-row-only catch-up")


@pytest.mark.parametrize("workers", [0, pytest.param(3, marks=pytest.mark.slow)])
async def test_greedy_and_seeded_mtp_spec_on_equals_off(agreeing_model, workers):
    """Greedy: tokens and every position's logits bit-identical with ``mtp`` speculation on and
    off; seeded sampling at two temperatures: the same text. Drafts are accepted (the block agrees
    with the trunk often, not always: accepted and rejected drafts both occur). Through 3 worker
    processes: every trunk expert computed remotely (the block's on the backbone's copy)."""
    prompts = [REPEATING, PROMPT, PROMPT]
    samplers = [lambda: None, lambda: Sampler(0.6, 0.95, seed=11), lambda: Sampler(1.2, 0.8, seed=12)]
    n = 64
    async with open_backbone(agreeing_model, workers=workers, transport="socket") as swarm:
        bb = swarm.backbone
        before = bb.dispatcher.stats.snapshot()
        off, _ = await _run(bb, prompts, [f() for f in samplers], None, n)
        speculation = Speculation("mtp", 3)
        on, spec = await _run(bb, prompts, [f() for f in samplers], speculation, n)
        stats = bb.dispatcher.stats.since(before)
    _assert_same_runs(off, on, n)
    assert 0 < spec.accepted < spec.drafted, spec
    if workers:  # the block's experts: the backbone's copy where faster than a round trip (here), else a worker
        assert stats.fallbacks == 0 and stats.requests > 0
        assert 0 < stats.local_groups <= speculation.mtp.bank.groups, "a trunk expert computed locally"


def _assert_same_runs(off, on, n):
    """Tokens and every emitted position's logits, bit for bit."""
    for (t0, r0), (t1, r1) in zip(off, on):
        assert t0 == t1 and len(t0) == n
        assert r0.keys() == r1.keys() == set(range(len(r0)))
        for p in r0:
            assert np.array_equal(r0[p], r1[p]), p


@pytest.mark.slow
def test_speculate_mtp_refusals(models_dir, glm_f32, ds2_f32, tmp_path):
    """A deepseek2 file without a block (named with what it has), deepseek2 and qwen35moe files
    that claim a block they lack, MTP blocks missing a tensor and with a tensor of the wrong shape:
    one line each, naming the file's block or the tensor; make-model writes deepseek2's block."""
    from gguf import GGUFValueType as T

    def generate(path, n: int = 2):
        return run_cli("generate", str(path), "--prompt", "hello", "--max-tokens", str(n), "--speculate", "mtp")

    assert_one_line_error(generate(_ds2(models_dir)), "--speculate mtp", "deepseek2, 4 layers",
                          "no MTP (NextN) block", "deepseek2.nextn_predict_layers")
    for trunk, key, il in ((_ds2(models_dir), "deepseek2", 3), (_q35(models_dir), "qwen35moe", 2)):
        claims = rewrite(trunk, tmp_path / "claims.gguf", set_keys={f"{key}.nextn_predict_layers": (1, T.UINT32, None)})
        assert_one_line_error(generate(claims), "MTP block tensor", f"blk.{il}.nextn.eh_proj.weight", "missing")
    for src, name in ((ds2_f32, "blk.4.attn_kv_a_norm.weight"), (ds2_f32, "blk.4.nextn.enorm.weight"),
                      (glm_f32, "blk.4.nextn.enorm.weight")):
        short = rewrite(src, tmp_path / "short.gguf", replace_tensor={name: np.ones(64, np.float32)})
        assert_one_line_error(generate(short), "MTP block tensor", name, "shape")
    bad = rewrite(glm_f32, tmp_path / "bad-block.gguf", drop_tensor="blk.4.nextn.hnorm.weight")
    assert_one_line_error(generate(bad), "blk.4.nextn.hnorm.weight")
    proc = generate(glm_f32, 4)
    assert proc.returncode == 0, proc.stderr
    for arch in ("deepseek2", "qwen35moe"):  # make-model writes the block on request, generate drafts with it
        made = tmp_path / f"{arch}-block.gguf"
        proc = run_cli("make-model", "--arch", arch, "--mtp-blocks", "1", "-q", "-o", str(made))
        assert proc.returncode == 0, proc.stderr
        proc = generate(made, 4)
        assert proc.returncode == 0, proc.stderr
        proc = run_cli("make-model", "--arch", arch, "--mtp-blocks", "2", "-q", "-o", str(tmp_path / "x.gguf"))
        assert_one_line_error(proc, "--mtp-blocks (n_nextn) must be 0 or 1")
        assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("micro_batches", [1, 2])
async def test_concurrent_mtp_speculating_sequences_equal_each_alone(agreeing_model, micro_batches):
    """Four sequences drafting with the MTP block in the same steps (in pipelined micro-batches or
    not), prefills and decodes mixed: each one's tokens equal its own run alone without
    speculation, and drafts are accepted."""
    import trio

    from p2pswarm.backbone.serving.scheduler import Params, Scheduler

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(4 + 2 * i)] for i in range(4)]
    samplers = [None, Sampler(0.8, 0.9, seed=1), None, Sampler(1.1, 0.95, seed=3)]
    n = 24
    async with open_backbone(agreeing_model, workers=2, transport="inproc") as swarm:
        bb = swarm.backbone
        want = [(await _run(bb, [p], [s], None, n))[0][0][0] for p, s in zip(prompts, samplers)]
        speculation = Speculation("mtp", 3, costs=FreeDrafts())  # every step drafts (not timings' choice)
        sched = Scheduler(bb, None, micro_batches=micro_batches, speculate=speculation)
        # the block's experts: where the backbone's dispatcher puts them (its replica, or a worker)
        assert speculation.mtp is not None and speculation.mtp.bank.dispatcher is bb.dispatcher
        got: dict[int, list[int]] = {}

        async def one(i, req):
            async with req:
                got[i] = [s.token async for s in req]

        reqs = [sched.submit(p, Params(max_tokens=n, sampler=s, stop_at_eos=False))
                for p, s in zip(prompts, samplers)]
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as clients:
                for i, r in enumerate(reqs):
                    clients.start_soon(one, i, r)
                await nursery.start(sched.run)
            nursery.cancel_scope.cancel()
    assert [got[i] for i in range(4)] == want
    assert 0 < sched.spec.accepted < sched.spec.drafted, sched.spec


async def test_rejected_mtp_drafts_leave_the_mla_caches_as_never_drafting(ds2_agreeing):
    """deepseek2: rounds of MTP drafts verified greedily (the last draft of each round replaced by a
    token the block did not pick, so drafts are rejected as well as accepted) leave every trunk
    layer's MLA latent cache and the block's own latent cache bit-identical to a sequence that
    decoded the same tokens one by one and drafted at the same points without verifying; each
    round's drafts are the same on both."""
    async with open_backbone(ds2_agreeing, workers=0) as swarm:
        bb = swarm.backbone
        bb.keep_hidden = True
        block = block_for(bb)
        spec, clean = bb.new_state(), bb.new_state()
        nxt = int(np.argmax((await bb.forward(PROMPT, spec))[-1]))
        await bb.forward(PROMPT, clean)
        fed, accepted, rejected = list(PROMPT), 0, 0
        for _ in range(6):
            drafts = block.draft(spec, fed + [nxt], 3)
            assert drafts == block.draft(clean, fed + [nxt], 3) and len(drafts) == 3
            drafts[-1] = (drafts[-1] + 1) % bb.model.n_vocab
            rows = (await bb.forward_batch([([nxt, *drafts], spec)], verify=[True]))[0]
            keep = 1
            while keep <= len(drafts) and int(np.argmax(rows[keep - 1])) == drafts[keep - 1]:
                keep += 1
            bb.keep_positions(spec, keep)
            accepted, rejected = accepted + keep - 1, rejected + len(drafts) - (keep - 1)
            for t in [nxt, *drafts[:keep - 1]]:
                await bb.forward([t], clean)
            fed += [nxt, *drafts[:keep - 1]]
            nxt = int(np.argmax(rows[keep - 1]))
        block.draft(spec, fed + [nxt], 1), block.draft(clean, fed + [nxt], 1)  # the settled positions into the block
    assert accepted > 0 and rejected > 0
    assert spec.n_past == clean.n_past == len(fed)
    for il in range(bb.model.n_layer):
        a, b = spec.extra[il], clean.extra[il]
        assert a.n == b.n == len(fed) and np.array_equal(a.rows[:a.n], b.rows[:b.n]), il
    a, b = spec.mtp.kv, clean.mtp.kv
    assert spec.mtp.fed == clean.mtp.fed == len(fed) and a.n == b.n
    assert np.array_equal(a.rows[:a.n], b.rows[:b.n])


def test_shards_carry_the_mtp_blocks_experts(ds2_agreeing, tmp_path):
    """``slice`` over all layers keeps the block's layer: a worker holds its experts like any layer's."""
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.slicer import slice_experts

    layout = ModelLayout.open(ds2_agreeing)
    assert layout.expert_layers == [1, 2, 3, 4]  # 1 dense + 3 MoE trunk layers, the block (4)
    slice_experts(layout.path, tmp_path / "s.gguf", None, (4, 8))
    shard = ModelLayout.open(tmp_path / "s.gguf")
    assert shard.expert_layers == [1, 2, 3, 4] and shard.holds(4, 5) and not shard.holds(4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek2", "qwen35moe"])
async def test_mtp_experts_go_to_worker_processes_without_a_local_copy(arch, models_dir):
    """``--expert-cache none``: the backbone holds none of the block's experts, so its drafts'
    experts are computed by the 3 worker processes, which advertise the block's layer: tokens and
    every position's logits bit-identical to speculation off, drafts accepted, no fallback, no
    expert computed on the backbone."""
    model = _mtp_model(models_dir, arch, "agree")
    prompts, n = [REPEATING, PROMPT], 64
    async with open_backbone(model, workers=3, transport="socket", expert_cache=parse_cache_size("none")) as swarm:
        bb = swarm.backbone
        il, owners = bb.model.n_layer, bb.dispatcher.owners
        assert len(owners) == 3 and all(o.remote for o in owners)
        assert all(any(o.holds(il, e) for o in owners) for e in range(bb.model.n_expert))
        assert not any(bb.dispatcher.local.holds(il, e) for e in range(bb.model.n_expert))
        off, _ = await _run(bb, prompts, [None, None], None, n)
        before = bb.dispatcher.stats.snapshot()
        speculation = Speculation("mtp", 3)
        on, spec = await _run(bb, prompts, [None, None], speculation, n)
        stats = bb.dispatcher.stats.since(before)
    _assert_same_runs(off, on, n)
    assert 0 < spec.accepted < spec.drafted, spec
    assert speculation.mtp.bank.groups > 0
    assert stats.fallbacks == 0 and stats.local_groups == 0 and stats.remote_groups > 0


async def test_a_draft_whose_experts_no_one_holds_is_skipped(ds2_agreeing):
    """A draft is optional: when the block's units have no live owner (every replica gone), the
    step gets no draft, not an error, and the block's state is as before; once they are back it
    drafts what a block that never failed drafts."""
    from p2pswarm.errors import UnitsUnavailable

    class Gone:
        def forward_groups(self, layer, cur, groups):
            raise UnitsUnavailable("no live owner holds them", layer=layer, experts=[e for e, _ in groups])

    async with open_backbone(ds2_agreeing, workers=0) as swarm:
        bb = swarm.backbone
        bb.keep_hidden = True
        st = bb.new_state()
        nxt = int(np.argmax((await bb.forward(PROMPT, st))[-1]))
        block = MtpBlock(bb.model, Gone())
        assert block.draft(st, PROMPT + [nxt], 3) == []
        assert st.mtp.fed == 0 and st.mtp.kv.n == 0
        block.bank = ExpertBank(bb.model.layout)
        got = block.draft(st, PROMPT + [nxt], 3)
        ref = bb.new_state()
        await bb.forward(PROMPT, ref)
    assert len(got) == 3 and got == MtpBlock(bb.model, ExpertBank(bb.model.layout)).draft(ref, PROMPT + [nxt], 3)


@pytest.mark.slow
async def test_draft_length_shrinks_when_a_draft_costs_a_round_trip_and_grows_when_drafts_are_free(models_dir):
    """The time-based draft length on a real run: a 1-layer qwen35moe whose block agrees with its
    trunk at 0.9, 2 worker processes each behind a WAN proxy of 60 ms round trip, so a step is one
    round trip plus its compute. With the block's experts on the backbone (a draft costs no round trip) sequences
    draft long; with none on the backbone (``--expert-cache none``: each draft token is one round
    trip to the workers, about what a step costs) they draft a token or none. Tokens equal speculation off's in both; no fallback."""
    from p2pswarm.net.wire.wanproxy import open_wan_proxy

    model = models_dir / "mtp-qwen35moe-1layer-agree.gguf"
    if not model.exists():
        make_model(model, arch="qwen35moe", preset="tiny", qtype="q8_0", layers=1, seed=46, mtp_agreement=0.9)
    got = {}
    for where, cache in (("local", None), ("workers", parse_cache_size("none"))):
        async with open_backbone(model, workers=2, transport="socket", expert_cache=cache) as swarm:
            async with open_wan_proxy(("127.0.0.1", swarm.workers[0].port), delay_s=0.03) as p0, \
                    open_wan_proxy(("127.0.0.1", swarm.workers[1].port), delay_s=0.03) as p1:
                for owner, proxy in zip(swarm.owners, (p0, p1)):
                    owner.port = proxy.port  # (no connection yet: the first request dials the proxy)
                bb = swarm.backbone
                off, _ = await _run(bb, [REPEATING], [None], None, 40)
                before = bb.dispatcher.stats.snapshot()
                speculation = Speculation("mtp", 4)
                on, spec = await _run(bb, [REPEATING], [None], speculation, 40)
                stats = bb.dispatcher.stats.since(before)
        assert on[0][0] == off[0][0], where
        assert stats.fallbacks == 0, (where, stats)
        got[where] = (spec.drafted / spec.verifications, spec, speculation.costs.draft_s, speculation.costs.row_s)
    print("drafts per verification, stats, s per draft token, s per row:", got)
    local, workers = got["local"], got["workers"]
    assert local[2] < 0.01 < 0.03 < workers[2]  # measured: a draft is free here, a round trip there
    # wide bounds (timings on a shared machine; 9-12 verifications a run): long where free, short where not
    assert local[0] >= 2.0 and workers[0] <= 2.0 and local[0] >= 1.5 * workers[0], got
