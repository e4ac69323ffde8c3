"""Shared by the expert cache's tests (test_expert_cache.py, test_expert_cache_swarm.py): the
tiny models they cut and a greedy streamed completion through a backbone's HTTP API."""
from __future__ import annotations

import json

from p2pswarm.model.synth import make_model

ARCHS = {"qwen35moe": dict(seed=21), "deepseek2": dict(seed=41)}


def arch_model(models_dir, arch: str):
    path = models_dir / f"cache-{arch}.gguf"
    if not path.exists():
        make_model(path, arch=arch, preset="tiny", **ARCHS[arch])
    return path


def _complete(base: str, prompt: str, n: int, *, on_piece=None) -> str:
    """A greedy streamed completion's text; ``on_piece(i)`` after each piece."""
    import httpx

    pieces = []
    with httpx.Client(base_url=base, timeout=180) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                        "stream": True}) as s:
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                pieces.append(ev["choices"][0]["text"])
                if on_piece is not None:
                    on_piece(len(pieces))
    return "".join(pieces)
