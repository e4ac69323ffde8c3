"""Hashes of the backbone's logits, for "the same bits before and after" across two source trees.

    PYTHONPATH=TREE python bench/logit_hashes.py [--dir D]   # once per tree, then diff the outputs

For tiny models of every architecture (qwen35moe Q8_0 and Q4_K_M, gpt-oss Q8_0, deepseek2 Q4_K_M
and Q8_0, glm4moe Q8_0, qwen3moe F32 and Q4_K_M; made once under ``--dir``) on the numpy and ggml
kernels, one line each: the sha256 (16 hex digits) of a prefill's all-position logits
(``generate.sequence_logits``), of the same tokens fed one decode step at a time, and of three steps of three sequences of mixed lengths
(``Backbone.forward_batch``) with and without the batch-invariant mode, a speculative verification
step among them (its positions kept in part after), and the same kind of steps with ``last_only``
(the scheduler's: each item's last row). A refactoring of the engine that claims no
behaviour change should print the same lines under both trees; ``verify_calls`` says which way
verification ran. The tree is whatever ``p2pswarm`` Python imports (``PYTHONPATH``).
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np
import trio

from p2pswarm.backbone.serving.generate import sequence_logits
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.model.synth import make_model

MODELS = [("qwen35moe", "q8_0"), ("qwen35moe", "q4_k_m"), ("gpt-oss", "q8_0"), ("deepseek2", "q4_k_m"),
          ("deepseek2", "q8_0"), ("glm4moe", "q8_0"), ("qwen3moe", "f32"), ("qwen3moe", "q4_k_m")]


def digest(arrs) -> str:
    m = hashlib.sha256()
    for a in arrs:
        m.update(np.ascontiguousarray(a).tobytes())
    return m.hexdigest()[:16]


async def hashes(path: Path, kernel: str) -> list[tuple[str, str]]:
    out = []
    async with open_backbone(path, workers=0, kernel=kernel) as local:
        bb = local.backbone
        V = bb.model.n_vocab
        toks = [(37 * i + 5) % V for i in range(9)]
        out.append(("prefill", digest([await sequence_logits(bb, toks)])))
        # one sequence fed token by token: the one-sequence decode step (gpt-oss's ggml one-graph step)
        out.append(("decode", digest([await sequence_logits(bb, toks, decode=True)])))
        for inv in (True, False):
            a, b, c = bb.new_state(), bb.new_state(), bb.new_state()
            r = await bb.forward_batch([(toks[:5], a), (toks[2:5], b), (toks[:1], c)], batch_invariant=inv)
            r += await bb.forward_batch([([toks[6]], a), ([toks[7]], b), (toks[1:4], c)], batch_invariant=inv)
            r += await bb.forward_batch([(toks[5:8], a), ([toks[3]], b)], verify=[True, False])
            bb.keep_positions(a, 2)
            r += await bb.forward_batch([([toks[8]], a), ([toks[4]], b), ([toks[0]], c)], batch_invariant=inv)
            out.append((f"steps batch_invariant={inv}", digest(r)))
            # the scheduler's steps: each item's last row only (the last layer then carries on only those)
            a, b, c = bb.new_state(), bb.new_state(), bb.new_state()
            r = await bb.forward_batch([(toks[:8], a), (toks[2:5], b), (toks[:1], c)], batch_invariant=inv,
                                       last_only=True)
            r += await bb.forward_batch([(toks[5:8], a), ([toks[3]], b)], verify=[True, False], last_only=True)
            bb.keep_positions(a, 2)
            r += await bb.forward_batch([([toks[8]], a), (toks[4:9], b), ([toks[0]], c)], batch_invariant=inv,
                                        last_only=True)
            out.append((f"last-row steps batch_invariant={inv}", digest(r)))
        out.append(("verify_calls", str(bb.verify_calls)))
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "p2pswarm" / "bench" / "hashes",
                    help="where the tiny models are made once")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    for arch, qtype in MODELS:
        path = a.dir / f"{arch}-{qtype}.gguf"
        if not path.exists():
            make_model(path, arch=arch, preset="tiny", seed=5, qtype=qtype)
        for kernel in ("numpy", "ggml"):
            for name, value in await hashes(path, kernel):
                print(arch, qtype, kernel, name, value, flush=True)


if __name__ == "__main__":
    trio.run(main)
