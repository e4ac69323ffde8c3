"""Steps that return each item's last row only (``forward_batch(last_only=True)``: the scheduler's
steps) carry on past the last layer's attention only the rows that reach an output, as llama.cpp's
``inp_out_ids`` does: that layer dispatches fewer (expert, row) pairs, every other layer the same,
and every logit keeps its bits. The reference is the same steps with every row carried through the
last layer (what ``keep_hidden``, the MTP drafter's switch, asks for: it keeps all rows' hidden
states), on every architecture with a layer graph of its own and on both kernels."""
from __future__ import annotations

import numpy as np
import pytest

from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model

from conftest import needs_llama
from helpers.arch_checks import SCHEDULE
from helpers.ggml import needs_ggml

MODELS = [("deepseek2", "q8_0"), pytest.param("deepseek2", "q4_k_m", marks=needs_llama), ("qwen35moe", "q8_0"),
          ("gpt-oss", "q8_0")]


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("ggml", marks=needs_ggml)])
@pytest.mark.parametrize("arch,qtype", MODELS)
async def test_last_row_steps_compute_only_the_out_rows_experts_exactly(models_dir, arch, qtype, kernel):
    path = models_dir / f"last-row-{arch}-{qtype}.gguf"
    if not path.exists():
        make_model(path, arch=arch, preset="tiny", qtype=qtype, seed=7)
    async with open_backbone(path, workers=0, kernel=kernel) as swarm:
        b = swarm.backbone
        L = b.model.n_layer
        pairs: list[tuple[int, int]] = []  # (layer, rows dispatched) per dispatch
        real = b.dispatcher.run_groups_local

        def counting(il, cur, groups):
            pairs.append((il, sum(len(rows) for _, rows in groups)))
            return real(il, cur, groups)

        b.dispatcher.run_groups_local = counting

        async def run(invariant: bool, every_row: bool):
            b.keep_hidden = every_row
            pairs.clear()
            states: dict = {}
            out = []
            for step in SCHEDULE:
                items = [(toks, states.setdefault(s, b.new_state())) for s, toks in step]
                out.append(await b.forward_batch(items, last_only=True, batch_invariant=invariant))
            return out, list(pairs)

        for invariant in (True, False):
            want, want_pairs = await run(invariant, every_row=True)
            got, got_pairs = await run(invariant, every_row=False)
            for w_step, g_step in zip(want, got):
                assert len(w_step) == len(g_step)
                for w, g in zip(w_step, g_step):
                    assert w.shape == g.shape == (1, b.model.n_vocab) and np.array_equal(w, g), invariant
            assert [p for p in got_pairs if p[0] < L - 1] == [p for p in want_pairs if p[0] < L - 1]
            last = [n for il, n in got_pairs if il == L - 1]
            last_all = [n for il, n in want_pairs if il == L - 1]
            # the steps with a prefill chunk dispatch fewer pairs in the last layer; none more
            assert all(n <= m for n, m in zip(last, last_all)) and sum(last) < sum(last_all), (last, last_all)


async def test_a_lone_prefill_runs_no_probe_and_still_skips_groups_without_its_last_row(models_dir):
    """A lone request's last-row step never runs the row-invariance probes (seconds at a big
    geometry, paid by a fresh server's first request): it sends only the last layer's groups that
    hold the last row, whole (exact without a probe), and its logits equal every row carried."""
    path = models_dir / "last-row-deepseek2-q8_0.gguf"
    if not path.exists():
        make_model(path, arch="deepseek2", preset="tiny", qtype="q8_0", seed=7)
    prompt = [(7 * j) % 400 + 3 for j in range(24)]
    got = {}
    for every_row in (True, False):
        async with open_backbone(path, workers=0) as swarm:
            b = swarm.backbone
            b.keep_hidden = every_row
            L = b.model.n_layer
            pairs: list[int] = []
            real = b.dispatcher.run_groups_local

            def counting(il, cur, groups):
                if il == L - 1:
                    pairs.append(sum(len(rows) for _, rows in groups))
                return real(il, cur, groups)

            b.dispatcher.run_groups_local = counting
            out = await b.forward_batch([(prompt, b.new_state())], last_only=True)
            assert b._row_invariant is None and not b._dense_invariant  # no probe ran
            got[every_row] = (out[0], sum(pairs))
    assert np.array_equal(got[True][0], got[False][0])
    assert 0 < got[False][1] < got[True][1], got
