"""What one routed expert computes, by architecture: the function every expert kernel must agree on.

Most architectures (qwen3moe, qwen35moe, ...): ``down(silu(gate x) * (up x))``.

``gpt-oss`` (llama.cpp's ``build_moe_ffn`` with ``LLM_FFN_SWIGLU_OAI_MOE``)::

    g = gate x + b_gate;  u = up x + b_up
    a = swiglu_oai(g, u) = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)
    out = down a + b_down

The router's weight multiplies ``out`` afterwards, on the backbone (so the down bias is the
worker's, inside the expert, as in llama.cpp). A kernel that cannot compute an architecture's
function refuses the model when its bank is made (one line saying why), never computes another.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32

#: ggml_swiglu_oai's constants as llama.cpp's build_moe_ffn passes them (not GGUF keys)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

SWIGLU = "swiglu"
SWIGLU_OAI = "swiglu_oai"

#: architectures whose experts are not plain SwiGLU
_ACTIVATION = {"gpt-oss": SWIGLU_OAI}


def activation(layout) -> str:
    """The expert activation of ``layout``'s architecture: ``swiglu`` or ``swiglu_oai``."""
    return _ACTIVATION.get(str(getattr(layout, "arch", "")), SWIGLU)


def has_biases(layout) -> bool:
    """Whether the experts of ``layout`` carry biases (``ffn_*_exps.bias``)."""
    return any(k.endswith("_bias") for kinds in layout.expert_tensors.values() for k in kinds)


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml's ``swiglu_oai`` element by element, float32, in its order of operations."""
    limit = F32(SWIGLU_OAI_LIMIT)
    x = np.minimum(g, limit)
    y = np.clip(u, -limit, limit)
    glu = x / (F32(1.0) + np.exp(F32(SWIGLU_OAI_ALPHA) * (-x)))
    return glu * (y + F32(1.0))


def oai_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, b_gate: np.ndarray,
               b_up: np.ndarray, b_down: np.ndarray) -> np.ndarray:
    """One gpt-oss expert on rows ``x`` (n, n_embd), float32 weights (out, in)."""
    g = x @ gate.T + b_gate
    u = x @ up.T + b_up
    return swiglu_oai(g, u) @ down.T + b_down
