"""The model's own MTP (NextN) block as the speculative drafter (issue 43, item 5): glm4moe and
qwen35moe.

The block's draft logits equal llama.cpp's own MTP context (``LLAMA_CONTEXT_TYPE_MTP``) within
1e-4 + 2e-5 * max|logit| on an F32 model, for a prefill of positions and two chained drafts; with
``--speculate mtp`` greedy tokens and every position's logits, and seeded texts, are the same as
without speculation, and drafts are accepted on a model whose block agrees with its trunk
(``make-model --mtp-agreement``), monolithic and through 3 worker processes."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.mtp import MtpBlock, MtpState
from p2pswarm.backbone.sampling import Sampler
from p2pswarm.backbone.session import open_backbone
from p2pswarm.backbone.speculation import Speculation
from p2pswarm.engine.experts import ExpertBank
from p2pswarm.model.synth import make_model

from conftest import assert_one_line_error, run_cli
from helpers.gguf_edit import rewrite
from helpers.speculating import PROMPT, REPEATING
from helpers.speculating import run_spec as _run


@pytest.fixture(scope="session")
def glm_f32(models_dir):
    path = models_dir / "mtp-glm-f32.gguf"
    if not path.exists():
        make_model(path, arch="glm4moe", preset="tiny", qtype="f32", seed=45)
    return path


@pytest.fixture(scope="session")
def q35_f32(models_dir):
    path = models_dir / "mtp-q35-f32.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="f32", seed=45, n_nextn=1)
    return path


@pytest.fixture(scope="session")
def q35_agreeing(models_dir):
    path = models_dir / "mtp-q35-agree.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=46, mtp_agreement=0.9)
    return path


@pytest.fixture(params=["glm4moe", "qwen35moe"])
def f32_model(request):
    return request.getfixturevalue({"glm4moe": "glm_f32", "qwen35moe": "q35_f32"}[request.param])


@pytest.fixture(params=["glm4moe", "qwen35moe"])
def agreeing_model(request):
    return request.getfixturevalue({"glm4moe": "glm_agreeing", "qwen35moe": "q35_agreeing"}[request.param])


@pytest.fixture(scope="session")
def glm_agreeing(models_dir):
    path = models_dir / "mtp-glm-agree.gguf"
    if not path.exists():
        make_model(path, arch="glm4moe", preset="tiny", qtype="q8_0", seed=46, mtp_agreement=0.9)
    return path


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
        on, spec = await _run(bb, prompts, [f() for f in samplers], Speculation("mtp", 3), n)
        stats = bb.dispatcher.stats.since(before)
    for (t0, r0), (t1, r1) in zip(off, on):
        assert t0 == t1 and len(t0) == n
        assert r0.keys() == r1.keys() == set(range(len(r0)))
        for p in r0:
            assert np.array_equal(r0[p], r1[p]), p
    assert 0 < spec.accepted < spec.drafted, spec
    if workers:
        assert stats.fallbacks == 0 and stats.local_groups == 0 and stats.requests > 0


@pytest.mark.slow
def test_speculate_mtp_refusals(models_dir, glm_f32, tmp_path):
    """An architecture whose block is not run yet (deepseek2), a qwen35moe file that claims a block
    it lacks, an MTP block missing a tensor and one with a tensor of the wrong shape: one line
    each, naming the file's block or the tensor."""
    from gguf import GGUFValueType as T

    ds = rewrite(_ds2(models_dir), tmp_path / "ds-mtp.gguf",
                 set_keys={"deepseek2.nextn_predict_layers": (1, T.UINT32, None)})
    proc = run_cli("generate", str(ds), "--prompt", "hello", "--max-tokens", "2", "--speculate", "mtp")
    assert_one_line_error(proc, "--speculate mtp", "1 MTP (NextN) block", "deepseek2",
                          "glm4moe, qwen35moe only")
    q35 = rewrite(_q35(models_dir), tmp_path / "q35-mtp.gguf",
                  set_keys={"qwen35moe.nextn_predict_layers": (1, T.UINT32, None)})
    proc = run_cli("generate", str(q35), "--prompt", "hello", "--max-tokens", "2", "--speculate", "mtp")
    assert_one_line_error(proc, "MTP block tensor", "blk.2.nextn.eh_proj.weight", "missing")
    bad = rewrite(glm_f32, tmp_path / "bad-block.gguf", drop_tensor="blk.4.nextn.hnorm.weight")
    proc = run_cli("generate", str(bad), "--prompt", "hello", "--max-tokens", "2", "--speculate", "mtp")
    assert_one_line_error(proc, "blk.4.nextn.hnorm.weight")
    short = rewrite(glm_f32, tmp_path / "short-block.gguf",
                    replace_tensor={"blk.4.nextn.enorm.weight": np.ones(64, np.float32)})
    proc = run_cli("generate", str(short), "--prompt", "hello", "--max-tokens", "2", "--speculate", "mtp")
    assert_one_line_error(proc, "blk.4.nextn.enorm.weight", "shape")
    proc = run_cli("generate", str(glm_f32), "--prompt", "hello", "--max-tokens", "4", "--speculate", "mtp")
    assert proc.returncode == 0, proc.stderr
    q35mtp = tmp_path / "q35-block.gguf"
    proc = run_cli("make-model", "--arch", "qwen35moe", "--mtp-blocks", "1", "-q", "-o", str(q35mtp))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("generate", str(q35mtp), "--prompt", "hello", "--max-tokens", "4", "--speculate", "mtp")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("make-model", "--arch", "qwen35moe", "--mtp-blocks", "2", "-q", "-o", str(tmp_path / "x.gguf"))
    assert_one_line_error(proc, "--mtp-blocks (n_nextn) must be 0 or 1")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("micro_batches", [1, 2])
async def test_concurrent_mtp_speculating_sequences_equal_each_alone(agreeing_model, micro_batches):
    """Four sequences drafting with the MTP block in the same steps (in pipelined micro-batches or
    not), prefills and decodes mixed: each one's tokens equal its own run alone without
    speculation, and drafts are accepted."""
    import trio

    from p2pswarm.backbone.scheduler import Params, Scheduler

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(4 + 2 * i)] for i in range(4)]
    samplers = [None, Sampler(0.8, 0.9, seed=1), None, Sampler(1.1, 0.95, seed=3)]
    n = 24
    async with open_backbone(agreeing_model, workers=2, transport="inproc") as swarm:
        bb = swarm.backbone
        want = [(await _run(bb, [p], [s], None, n))[0][0][0] for p, s in zip(prompts, samplers)]
        speculation = Speculation("mtp", 3)
        sched = Scheduler(bb, None, micro_batches=micro_batches, speculate=speculation)
        # the block's experts: a bank of its own, of the replica's kernel (numpy's first-use
        # dequantisation would cost more than the drafts save at the 122B's geometry)
        assert speculation.mtp is not None and speculation.mtp.bank is not bb.dispatcher.local.bank
        assert speculation.mtp.bank.kernel == bb.dispatcher.local.bank.kernel
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
