"""Exact speculative decoding (issue 43): a verification step computes each drafted position
exactly as a one-token decode step does (qwen35moe's DeltaNet recurrence and gated attention,
qwen3moe's attention), a rejected draft leaves the state bit-identical to never having drafted,
batched == alone holds with speculation, and through the scheduler greedy tokens and logits and
seeded sampled text are the same with speculation on and off, monolithic and through 3 worker
processes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from p2pswarm.backbone.serving.sampling import Sampler
from p2pswarm.backbone.serving.scheduler import Params, Scheduler
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.backbone.serving.speculation import (PROBE_EVERY, PRIOR_RATE, Adaptive, Costs, Speculation, choose_lengths, draft_lengths,
                                           ngram_draft, plan_drafts, probe_interval)
from p2pswarm.engine.arch.qwen35moe.deltanet import DeltaNetState
from p2pswarm.model.synth import make_model

from conftest import assert_one_line_error, run_cli
from helpers.ggml import needs_ggml
from helpers.speculating import PROMPT, REPEATING, FreeDrafts
from helpers.speculating import run_spec as _run

CONT = [129, 3, 250, 77, 41]  # the sampled token and four drafts after it


@pytest.fixture(scope="session")
def q35(models_dir):
    path = models_dir / "spec-q35.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", seed=43)
    return path


@pytest.fixture(params=["qwen35moe", "qwen3moe", pytest.param("qwen3moe-q4km", marks=pytest.mark.slow)])
def model(request, q35, tiny_q8):
    """qwen35moe (Q8_0), qwen3moe (Q8_0) and qwen3moe Q4_K_M: K-quant experts are not row-invariant
    on libggml, so the verified positions' expert groups go by the batch-invariant rules."""
    if request.param == "qwen3moe-q4km":
        return request.getfixturevalue("tiny_q4km")
    return q35 if request.param == "qwen35moe" else tiny_q8


@pytest.fixture(scope="session")
def other_archs(models_dir):
    paths = {}
    for arch in ("gpt-oss", "deepseek2", "glm4moe"):
        paths[arch] = models_dir / f"spec-{arch}.gguf"
        if not paths[arch].exists():
            make_model(paths[arch], arch=arch, preset="tiny", qtype="q8_0", seed=44)
    return paths


@pytest.fixture(params=["qwen35moe", "qwen3moe", "gpt-oss", "deepseek2", "glm4moe"])
def any_arch(request, q35, tiny_q8, other_archs):
    return {"qwen35moe": q35, "qwen3moe": tiny_q8}.get(request.param) or other_archs[request.param]


# -- sampling: one random number per (seed, stream, position) -------------------------------------
@pytest.mark.parametrize("temperature,top_p", [(0.4, 1.0), (0.8, 0.9), (1.5, 0.6)])
def test_sampling_depends_only_on_seed_stream_and_position(temperature, top_p):
    rows = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32) * 3
    forward = [Sampler(temperature, top_p, seed=7)(r, p) for p, r in enumerate(rows)]
    s = Sampler(temperature, top_p, seed=7)
    backward = [s(rows[p], p) for p in reversed(range(len(rows)))][::-1]
    again = [s(rows[p], p) for p in range(len(rows))]  # asked twice: the same token
    assert forward == backward == again
    assert forward != [Sampler(temperature, top_p, seed=8)(r, p) for p, r in enumerate(rows)]
    assert forward != [Sampler(temperature, top_p, seed=7, stream=1)(r, p) for p, r in enumerate(rows)]
    # every token is inside the top-p set of its row
    for r, tok in zip(rows, forward):
        z = r.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = np.searchsorted(np.cumsum(p[order]), top_p) + 1
        assert tok in order[:keep]


def test_sampling_draws_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(1.0, 1.0, seed=3)
    got = np.bincount([s(logits, p) for p in range(4000)], minlength=4) / 4000
    assert np.allclose(got, [0.5, 0.3, 0.15, 0.05], atol=0.03), got
    s = Sampler(1.0, 0.8, seed=3)  # top-p 0.8: tokens 0 and 1 only, renormalised
    got = np.bincount([s(logits, p) for p in range(4000)], minlength=4) / 4000
    assert got[2] == got[3] == 0 and abs(got[0] - 0.625) < 0.03, got


# -- the drafter and the adaptive length ------------------------------------------------------
def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # after the earlier "1 2 3"
    assert ngram_draft([4, 5, 6, 7], 2) == []  # nothing repeats
    assert ngram_draft([7, 8, 7], 4) == [8, 7]  # what there is


def _costs(step, draft_s: float | None) -> Costs:
    """Costs measured on steps of 1..6 rows taking ``step(rows)`` seconds, drafts ``draft_s`` a token."""
    c = Costs()
    for rows in (1, 2, 6, 1, 3, 1, 5):
        c.observe_step(step(rows), rows)
    if draft_s is not None:
        c.observe_draft(draft_s * 3, 3)
    return c


def test_step_cost_fit_recovers_the_row_price():
    c = _costs(lambda r: 0.2 + 0.004 * r, 0.01)
    assert abs(c.row_s - 0.004) < 1e-9 and abs(c.step_s(1) - 0.204) < 1e-9 and abs(c.draft_s - 0.01) < 1e-12
    same = Costs()
    for _ in range(3):
        same.observe_step(0.1, 1)
    assert same.row_s is None and abs(same.step_s(1) - 0.1) < 1e-12  # one row count: no slope yet

    first = Costs()
    first.observe_draft(0.070, 1)  # the first call: the block's graphs built, its first requests
    assert first.draft_s == 0.070  # known at once (a draft may be a round trip) ...
    first.observe_draft(0.003, 1)
    assert first.draft_s == 0.003  # ... and replaced by the second call's, not blended with it
    first.observe_draft(0.005, 1)
    assert abs(first.draft_s - (0.7 * 0.003 + 0.3 * 0.005)) < 1e-12  # then an EWMA


def test_draft_length_follows_acceptance_and_what_a_draft_costs_against_a_step():
    """The controller on measured inputs: long drafts where a step is a WAN's round trips and rows
    and drafts are free; short or none where a draft token costs a round trip against a cheap
    step, where acceptance is low, or in a compute-bound batch of many."""
    wan = _costs(lambda r: 0.2 + 0.001 * r, 0.0001)  # 4 layers x 50 ms; the block's experts local
    assert choose_lengths([0.8], [4], wan) == [4]
    assert choose_lengths([0.02], [4], wan) == [1]  # a row costs 1 ms, it gains 0.02 x 0.2 s
    assert choose_lengths([0.001], [4], wan) == [0]
    slow_draft = _costs(lambda r: 0.2 + 0.001 * r, 0.05)  # the block's experts behind 50 ms too
    assert choose_lengths([0.8], [4], slow_draft) == [3]
    lan = _costs(lambda r: 0.02 + 0.001 * r, 0.05)  # a fast step: a draft's round trip never pays
    assert choose_lengths([0.95], [4], lan) == [0]
    assert choose_lengths([0.95], [4], _costs(lambda r: 0.02 + 0.001 * r, 0.0001)) == [4]  # free again
    compute = _costs(lambda r: 0.01 + 0.01 * r, 0.0)  # CPU-bound: a row costs what a token costs
    assert choose_lengths([0.5] * 8, [4] * 8, compute) == [0] * 8
    assert choose_lengths([0.9], [4], compute) == [3]  # alone, with drafts that usually pass
    assert choose_lengths([0.9, 0.3], [4, 4], wan) == [4, 2]  # WAN-bound: both draft, the surer longer
    assert choose_lengths([0.9, 0.3], [2, 0], wan) == [2, 0]  # caps (max_tokens) hold
    assert choose_lengths([0.5], [4], Costs()) == [1]  # nothing measured: it drafts, and measures ...
    assert choose_lengths([0.5], [4], _costs(lambda r: 0.2, None)) == [1]  # ... one token before a draft's cost
    unknown_step = Costs()
    unknown_step.observe_draft(0.001, 1)
    assert choose_lengths([0.5], [4], unknown_step) == [4]


def test_acceptance_decays_to_what_the_drafts_get_and_a_sequence_that_drafts_nothing_probes():
    a = Adaptive()
    assert a.rate == PRIOR_RATE
    for _ in range(12):
        a.observe(2, 0)
    assert a.rate < 0.01
    for _ in range(12):
        a.observe(4, 4)
    assert a.rate > 0.95
    a.observe(4, 1)  # 1 passed, the 2nd failed: 2 checked
    assert 0.8 < a.rate < 0.95
    pool = Adaptive()
    b = Adaptive(pool)
    for _ in range(12):
        b.observe(3, 0)
    assert Adaptive(pool).rate == pool.rate < 0.01  # a new sequence starts from what the others got

    seq = SimpleNamespace(sid=1, prompt=[1, 2], replay=SimpleNamespace(forced=0, tokens=[]), n_out=0,
                          params=SimpleNamespace(max_tokens=100), state=None, adaptive=None)
    spec = Speculation("ngram", draft_max=4, drafter=lambda toks, k: [5] * k, costs=_costs(lambda r: 0.2 + 0.001 * r, 0.01))
    lengths = []
    for _ in range(40):
        drafts = plan_drafts(spec, [seq], draft_lengths(spec, [seq]))
        lengths.append(len(drafts.get(1, [])))
        if drafts:
            seq.adaptive.observe(len(drafts[1]), 0)
    assert lengths[0] >= 3 and set(lengths[-24:]) == {0, 1} and lengths[-24:].count(1) == 3, lengths  # probes
    assert spec.costs.draft_s < 0.05  # the probes measured this drafter: near free
    dear = _costs(lambda r: 0.05 + 0.001 * r, 0.1)  # a draft token costs 2 steps: probes take <= 5 %
    assert probe_interval(dear, 1) == 40 and probe_interval(spec.costs, 1) == PROBE_EVERY


def test_short_requests_still_probe_so_a_draft_cost_measured_too_high_comes_down():
    """A draft cost once measured far too high (a cold page cache under the block's experts) made
    the probe interval longer than any request, and a new sequence starts idle: nobody probed again,
    drafting stopped for good. The scheduler's clock probes when nobody drafted for the interval."""
    spec = Speculation("ngram", draft_max=4, drafter=lambda toks, k: [5] * k, costs=_costs(lambda r: 0.2 + 0.001 * r, None))
    spec.costs.observe_draft(9.0, 1)  # the first call: one-time costs
    spec.costs.observe_draft(0.6, 1)  # the second, still cold (3 steps): replaces the first
    first = probe_interval(spec.costs, 1)
    assert first > 50  # longer than every request below
    probes, sid = 0, 0
    for _ in range(40):  # 40 requests of 6 steps each, one after another
        sid += 1
        seq = SimpleNamespace(sid=sid, prompt=[1, 2], replay=SimpleNamespace(forced=0, tokens=[]), n_out=0,
                              params=SimpleNamespace(max_tokens=7), state=None, adaptive=None)
        for _ in range(6):
            drafts = plan_drafts(spec, [seq], draft_lengths(spec, [seq]))
            if drafts:
                probes += 1
                seq.adaptive.observe(len(drafts[sid]), 1)
            seq.n_out += 1
    assert probes >= 3, probes  # main before the fix: 0 (each sequence idle for 6 steps < the interval)
    assert spec.costs.draft_s < 0.3 and probe_interval(spec.costs, 1) < first  # measured again: it came down


# -- the runner: verified positions == one-token decode steps; rollback leaves no trace -------------
def _layer_arrays(st):
    out = {}
    for il, kv in st.kv.items():
        out[("k", il)] = kv.k[: kv.n].copy()
        out[("v", il)] = kv.vt[..., : kv.n].copy()
        out[("first", il)] = np.array(getattr(kv, "first", 0))
    for il, x in st.extra.items():
        if isinstance(x, DeltaNetState):
            out[("S", il)] = x.buf.copy()
            out[("conv", il)] = x.conv.copy()
        else:
            out[("lat", il)] = x.rows[: x.n].copy()
    return out


def assert_same_state(a, b):
    assert a.n_past == b.n_past
    x, y = _layer_arrays(a), _layer_arrays(b)
    assert x.keys() == y.keys()
    for key in x:
        assert x[key].shape == y[key].shape and np.array_equal(x[key], y[key]), key


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
async def test_verified_positions_equal_decode_steps_and_rollback_is_exact(any_arch, kernel):
    """Every architecture: its KV caches (gpt-oss's sliding window trimmed mid-verification), MLA's
    latent cache, qwen35moe's DeltaNet state."""
    async with open_backbone(any_arch, workers=0, kernel=kernel) as mono:
        bb = mono.backbone
        ref = bb.new_state()
        await bb.forward(PROMPT, ref)
        want = [(await bb.forward([t], ref))[0] for t in CONT]
        after = (await bb.forward([99], ref))[0]
        for keep in (1, 3, 5):
            st = bb.new_state()
            await bb.forward(PROMPT, st)
            rows = (await bb.forward_batch([(CONT, st)], verify=[True]))[0]
            assert rows.shape == (len(CONT), len(want[0]))
            for i, w in enumerate(want):
                assert np.array_equal(rows[i], w), f"position {i}"
            bb.keep_positions(st, keep)
            clean = bb.new_state()  # the state that never saw the rejected drafts
            await bb.forward(PROMPT, clean)
            for t in CONT[:keep]:
                await bb.forward([t], clean)
            assert_same_state(st, clean)
            nxt = [(await bb.forward([t], st))[0] for t in [*CONT[keep:], 99]]
            if keep == len(CONT):
                assert np.array_equal(nxt[0], after)
            else:
                assert np.array_equal(nxt[0], want[keep])  # the rejected position fed again: the same bits
        # which path verified: one chunk per layer where the model's layer graphs take it (qwen35moe
        # on the ggml kernel), position by position elsewhere (chunk_verify says why)
        chunked = kernel == "ggml" and bb.model.arch == "qwen35moe"
        assert bb.verify_calls["chunk" if chunked else "rounds"] == 3 * bb.model.n_layer, bb.verify_calls
        assert bb.verify_calls["rounds" if chunked else "chunk"] == 0, bb.verify_calls


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
async def test_chunked_verification_spec_on_equals_off_over_64_tokens(q35, kernel):
    """qwen35moe, greedy, 64 tokens: the tokens and every emitted position's logits equal the run
    without speculation, with drafts accepted whole, in part and not at all; on the ggml kernel
    every verification ran as one chunk per layer (DeltaNet stepped per position inside the
    layer's graph, each attention row a decode row), on numpy position by position."""
    n = 64
    async with open_backbone(q35, workers=0, kernel=kernel) as mono:
        bb = mono.backbone
        off, _ = await _run(bb, [REPEATING, PROMPT], [None, None], None, n)
        calls = dict(bb.verify_calls)
        assert calls == {"chunk": 0, "rounds": 0}
        spec = Speculation("ngram", 4, drafter=_oracle([REPEATING, PROMPT], [t for t, _ in off]))
        on, stats = await _run(bb, [REPEATING, PROMPT], [None, None], spec, n)
    for (t0, r0), (t1, r1) in zip(off, on):
        assert t0 == t1 and len(t0) == n
        assert r0.keys() == r1.keys()
        for p in r0:
            assert np.array_equal(r0[p], r1[p]), p
    assert 0 < stats.accepted < stats.drafted, stats
    layers = stats.verifications * bb.model.n_layer
    assert bb.verify_calls == ({"chunk": layers, "rounds": 0} if kernel == "ggml" else {"chunk": 0, "rounds": layers})


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
async def test_verification_batched_equals_alone(model, kernel):
    """A verifying sequence in a step with a decoding and a prefilling one (batch-invariant mode):
    every sequence gets the bits it gets alone."""
    async with open_backbone(model, workers=0, kernel=kernel) as mono:
        bb = mono.backbone

        async def fresh(prompt):
            st = bb.new_state()
            await bb.forward(prompt, st)
            return st

        a, b = await fresh(PROMPT), await fresh([9, 120, 2])
        got = await bb.forward_batch([(CONT, a), ([17], b), ([44, 45, 46, 47], bb.new_state())],
                                     verify=[True, False, False], batch_invariant=True)
        a1 = await fresh(PROMPT)
        alone_a = (await bb.forward_batch([(CONT, a1)], verify=[True]))[0]
        alone_b = await bb.forward([17], await fresh([9, 120, 2]))
        alone_c = await bb.forward([44, 45, 46, 47], bb.new_state())
        for x, y in zip(got, [alone_a, alone_b, alone_c]):
            assert x.shape == y.shape and np.array_equal(x, y)


# -- the scheduler: spec on == spec off -----------------------------------------------------------
def _oracle(prompts, wanted):
    """A test drafter: the continuation the run without speculation produced, with every fifth
    position's draft wrong, so steps accept all, some and none of their drafts; nothing where
    the history is off that continuation."""
    def draft(history, k):
        for prompt, toks in zip(prompts, wanted):
            n = len(history) - len(prompt)
            if history[:len(prompt)] == prompt and history[len(prompt):] == toks[:n]:
                got = toks[n:n + k]
                return [t if (n + j) % 5 != 3 else (t + 1) % 500 for j, t in enumerate(got)]
        return []  # off the reference (a liar's rows changed a token, before the replay): no draft
    return draft


@pytest.mark.parametrize("workers", [0, pytest.param(3, marks=pytest.mark.slow)])
async def test_greedy_and_seeded_spec_on_equals_off(model, workers):
    """Greedy: tokens and every position's logits bit-identical with speculation on and off;
    seeded sampling at three temperatures: the same text. Drafts from the prompt-lookup drafter,
    and from a test drafter that knows the answer but is wrong at every fifth position (full,
    partial and rejected drafts). Through 3 worker processes, every expert computed remotely."""
    prompts = [REPEATING, PROMPT, REPEATING, PROMPT]
    samplers = [lambda: None, lambda: Sampler(0.6, 0.95, seed=11), lambda: Sampler(1.2, 0.8, seed=12),
                lambda: Sampler(0.3, 1.0, seed=13)]
    n = 64
    async with open_backbone(model, workers=workers, transport="socket") as swarm:
        bb = swarm.backbone
        before = bb.dispatcher.stats.snapshot()
        off, _ = await _run(bb, prompts, [f() for f in samplers], None, n)
        wanted = [toks for toks, _ in off]
        # the oracle drafts its cap of 3 every step (FreeDrafts), not timings' choice: from position
        # 4 (mod 5) a draft is accepted whole, from 3 rejected whole, from 1 in part, so a run's
        # acceptance is about 0.5 on any machine (adaptive lengths made it 0.49-0.6 with the load)
        oracle = Speculation("ngram", 3, drafter=_oracle(prompts, wanted), costs=FreeDrafts())
        runs = [await _run(bb, prompts, [f() for f in samplers], spec, n)
                for spec in (Speculation("ngram", 4), oracle)]
        stats = bb.dispatcher.stats.since(before)
    for on, spec in runs:
        for (t0, r0), (t1, r1) in zip(off, on):
            assert t0 == t1 and len(t0) == n
            assert r0.keys() == r1.keys() == set(range(len(r0)))
            for p in r0:
                assert np.array_equal(r0[p], r1[p]), p
        assert spec.drafted > 0 and spec.verifications > 0, spec
    oracle_stats = runs[1][1]
    assert 0.3 * oracle_stats.drafted < oracle_stats.accepted < 0.8 * oracle_stats.drafted, oracle_stats
    if workers:
        assert stats.fallbacks == 0 and stats.local_groups == 0 and stats.requests > 0


async def test_token_budget_counts_a_speculating_sequence_as_its_rows(tiny_f32):
    """A decoding sequence with k drafts takes 1 + k rows of the step's token budget: the rows the
    step computes for it (and whose experts it sends), so prefill chunks fill only what is left."""
    async with open_backbone(tiny_f32, workers=0) as mono:
        sched = Scheduler(mono.backbone, token_budget=16, prefill_chunk=4)
        for i in range(5):
            sched.submit([1 + i] * 4)
        sched._admit()
        first = sched._active[0]
        first.fed, first.next_token = len(first.prompt), 1  # decoding
        assert len(sched.plan()) == 1 + 3  # 1 decode row + 3 chunks of 4 in 16 rows
        assert len(sched.plan({first.sid: [7, 8, 9, 10]})) == 1 + 2  # 5 rows + 2 chunks of 4
        assert len(sched.plan({first.sid: [7]})) == 1 + 3  # 2 rows + 3 chunks of 4


def test_speculate_auto_is_mtp_where_the_file_has_a_block_else_off(tiny_q8, models_dir):
    """``--speculate auto`` (the default): mtp on a model with an MTP block, off on one without,
    the log saying which and why."""
    from p2pswarm.backbone.serving.speculation import auto_mode
    from p2pswarm.model.layout import ModelLayout

    mode, why = auto_mode(ModelLayout.open(tiny_q8))
    assert mode == "off" and "no MTP" in why
    path = models_dir / "spec-q35-mtp.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", layers=2, seed=43, mtp_agreement=1.0)
    mode, why = auto_mode(ModelLayout.open(path))
    assert mode == "mtp" and "1 MTP block" in why


@pytest.mark.slow
def test_generate_speculates_by_default_where_the_file_has_an_mtp_block(tiny_q8, models_dir):
    """The CLI's default ``--speculate auto``, logged: off on a file without a block, mtp on one
    with (and it drafts)."""
    path = models_dir / "spec-q35-mtp.gguf"
    if not path.exists():
        make_model(path, arch="qwen35moe", preset="tiny", qtype="q8_0", layers=2, seed=43, mtp_agreement=1.0)
    proc = run_cli("generate", str(tiny_q8), "--prompt", "hello", "--max-tokens", "2")
    assert proc.returncode == 0 and "--speculate auto: off" in proc.stderr, proc.stderr
    proc = run_cli("generate", str(path), "--prompt", "hello", "--max-tokens", "2")
    assert proc.returncode == 0 and "--speculate auto: mtp" in proc.stderr, proc.stderr
    assert "drafted tokens accepted" in proc.stdout + proc.stderr


def test_speculate_mtp_is_one_line_naming_what_the_file_has(tiny_q8):
    """No MTP block: says so (a block whose architecture is not run yet: tests/test_mtp.py). A bad
    K: one line too."""
    proc = run_cli("generate", str(tiny_q8), "--prompt", "hello", "--max-tokens", "2", "--speculate", "mtp")
    assert_one_line_error(proc, "--speculate mtp", "qwen3moe", "no MTP")
    proc = run_cli("generate", str(tiny_q8), "--prompt", "hello", "--speculate", "ngram", "--draft-max", "0")
    assert_one_line_error(proc, "--draft-max must be >= 1")


async def test_api_usage_health_and_metrics_report_drafts_and_the_text_is_unchanged(tiny_f32):
    """The OpenAI API's usage counts the drafts (accepted / rejected prediction tokens), /health,
    /v1/swarm (the status page) and /metrics the acceptance; the texts, greedy and seeded, equal a backbone's without speculation."""
    import httpx
    import trio

    from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
    from p2pswarm.engine.text.tokenizer import Tokenizer

    bodies = [{"prompt": "one two one two one two one two", "max_tokens": 32, "temperature": 0},
              {"prompt": "the swarm the swarm the swarm", "max_tokens": 32, "temperature": 0.7, "seed": 5},
              {"prompt": "hello hello hello", "max_tokens": 32, "temperature": 1.1, "top_p": 0.9, "seed": 6}]
    seen: dict = {}
    async with open_backbone(tiny_f32, workers=0) as swarm:
        tok = Tokenizer.from_gguf(tiny_f32)
        for spec in (None, Speculation("ngram", 4)):
            sched = Scheduler(swarm.backbone, tok, speculate=spec)
            app = CompletionsApp(swarm.backbone, tok, "tiny", swarm.fingerprint, model_path=tiny_f32, scheduler=sched)

            def client(base, key=spec is not None):
                with httpx.Client(base_url=base, timeout=60) as c:
                    got = [c.post("/v1/completions", json=b).json() for b in bodies]
                    health = c.get("/health").json()["speculation"]
                    assert c.get("/v1/swarm").json()["speculation"] == health  # the status page's panel
                    seen[key] = ([g["choices"][0]["text"] for g in got], [g["usage"] for g in got], health,
                                 c.get("/metrics").text)

            async with trio.open_nursery() as nursery:
                binds = await nursery.start(serve_http, app, "127.0.0.1", 0)
                with trio.fail_after(120):
                    await trio.to_thread.run_sync(client, binds[0].replace("0.0.0.0", "127.0.0.1"))
                nursery.cancel_scope.cancel()
    (off_texts, off_usage, off_health, _), (texts, usage, health, metrics) = seen[False], seen[True]
    assert texts == off_texts
    assert all(u["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
               for u in off_usage) and off_health["drafted"] == 0 and off_health["mode"] == "off"
    accepted = sum(u["completion_tokens_details"]["accepted_prediction_tokens"] for u in usage)
    rejected = sum(u["completion_tokens_details"]["rejected_prediction_tokens"] for u in usage)
    assert health["mode"] == "ngram" and health["drafted"] == accepted + rejected > 0 and health["accepted"] == accepted
    assert f'p2pswarm_draft_tokens_total{{outcome="accepted"}} {float(accepted)}' in metrics
    assert f'p2pswarm_draft_tokens_total{{outcome="rejected"}} {float(rejected)}' in metrics
    assert "p2pswarm_draft_acceptance" in metrics


async def test_replay_on_ban_with_speculation_ends_equal_to_monolithic(tiny_f32):
    """A worker falsifying some rows is caught mid-run while sequences speculate: every running
    sequence is replayed (its drafts' positions, kept or dropped, counted as tainted) and ends
    token for token equal to the monolithic run without speculation."""
    import trio

    from p2pswarm.backbone.dispatch.dispatcher import InProcessOwner
    from p2pswarm.backbone.serving.replay import Rewind
    from p2pswarm.backbone.sessions.local import ensure_shards
    from p2pswarm.market.verify import Verifier
    from p2pswarm.model.layout import ModelLayout
    from p2pswarm.model.manifest import model_fingerprint

    from helpers.dishonest_worker import DishonestWorker

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + i)] for i in range(4)]
    samplers = [lambda i: None if i % 2 == 0 else Sampler(0.9, 0.95, seed=i)][0]
    n = 40

    async def run(bb, spec):
        sched = Scheduler(bb, None, micro_batches=1, speculate=spec)
        got = {}

        async def one(i, req):
            toks = []
            async with req:
                async for step in req:
                    if isinstance(step, Rewind):
                        del toks[step.keep:]
                    else:
                        toks.append(step.token)
            got[i] = toks

        reqs = [sched.submit(p, Params(max_tokens=n, sampler=samplers(i), stop_at_eos=False), rewinds=True)
                for i, p in enumerate(prompts)]
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as clients:
                for i, r in enumerate(reqs):
                    clients.start_soon(one, i, r)
                await nursery.start(sched.run)
            nursery.cancel_scope.cancel()
        return [got[i] for i in range(len(prompts))], sched.spec

    async with open_backbone(tiny_f32, workers=0, kernel="numpy") as mono:
        want, _ = await run(mono.backbone, None)
    async with open_backbone(tiny_f32, workers=2, transport="inproc", kernel="numpy") as swarm:
        layout = ModelLayout.open(tiny_f32)
        shards = ensure_shards(layout, model_fingerprint(layout), 2)
        disp = swarm.backbone.dispatcher
        disp.owners[1] = InProcessOwner(DishonestWorker(shards[1], kernel="numpy", fraction=0.02, delta=1.0, seed=2),
                                        "liar")
        disp.verifier = Verifier(0.05, seed=1)
        oracle = Speculation("ngram", 3, drafter=_oracle(prompts, want))
        got, spec = await run(swarm.backbone, oracle)
        replays = swarm.backbone.replays
    assert disp.bans.banned.keys() == {"liar"} and replays.sequences >= 1, (disp.bans.banned, replays)
    assert spec.accepted > 0
    assert got == want


@pytest.mark.parametrize("micro_batches", [1, 2])
async def test_concurrent_speculating_sequences_equal_each_alone(q35, micro_batches):
    """Four sequences speculating in the same steps (split into pipelined micro-batches or not, the
    ggml kernel's layer graphs and their kept results interleaving): each sequence's tokens equal
    its own run alone without speculation (batch-invariant mode)."""
    import trio

    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(4 + 2 * i)] for i in range(4)]
    samplers = [lambda i: None if i % 2 == 0 else Sampler(0.8, 0.9, seed=i)][0]
    n = 24
    async with open_backbone(q35, workers=2, transport="inproc") as swarm:
        bb = swarm.backbone
        want = []
        for i, p in enumerate(prompts):
            toks, _ = (await _run(bb, [p], [samplers(i)], None, n))[0][0]
            want.append(toks)
        sched = Scheduler(bb, None, micro_batches=micro_batches,
                          speculate=Speculation("ngram", 3, drafter=_oracle(prompts, want), costs=FreeDrafts()))
        got: dict[int, list[int]] = {}

        async def one(i, req):
            async with req:
                got[i] = [s.token async for s in req]

        reqs = [sched.submit(p, Params(max_tokens=n, sampler=samplers(i), stop_at_eos=False))
                for i, p in enumerate(prompts)]
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as clients:
                for i, r in enumerate(reqs):
                    clients.start_soon(one, i, r)
                await nursery.start(sched.run)
            nursery.cancel_scope.cancel()
    assert [got[i] for i in range(4)] == want
    assert sched.spec.accepted > 0 and sched.spec.accepted < sched.spec.drafted
    assert sched.last_micro_batches == micro_batches
