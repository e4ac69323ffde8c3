"""What every synthetic preset shares: the trunk's shape (:class:`Preset`, the fields and the
defaults each architecture's preset class builds on), the constants of the weight-scaling rule, the
tensor types of ``--type``/``--expert-type`` and the file-type key.

Each architecture's preset class lives in its own module (``synth_qwen3moe``, ``synth_qwen35moe``,
``synth_gptoss``, ``synth_glm4moe``, ``synth_deepseek2``) and writes its own keys and tensors; the
contract they meet the registry and the common option checks are in
:mod:`~p2pswarm.model.synth_arches`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar


def _gguf() -> Any:
    import gguf  # import cost only when a model is made

    return gguf


SYNTH_VERSION = 1  # bump when the bytes a given set of options produces change

#: ``progress(done_bytes, total_bytes, what)``; called after every tensor and between chunks.
Progress = Callable[[int, int, str], None]

QTYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
EXPERT_QTYPES = ("q4_k", "mxfp4")

ROUTER_NEAR_TIE_SCALE = 0.01
NORM_NOISE = 0.02
LOGIT_STD = 2.0


@dataclasses.dataclass(frozen=True)
class Preset:
    """The trunk's shape every architecture has, and the defaults of
    :class:`~p2pswarm.model.synth_arches.SynthPreset` that most architectures keep (no MTP block,
    no own checks, no own options, tied when the vocabulary is large)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    expert_qtype: str | None = None  # None: the experts follow ``qtype``

    #: make_model keywords only this architecture takes (the dataclass fields they set)
    KEYWORDS: ClassVar[tuple[str, ...]] = ()
    #: whether ``--type q4_k_m`` may keep directly written Q4_K experts (llama.cpp requantising
    #: where Q4_K_M wants another type) rather than refusing the combination
    Q4_K_M_KEEPS_Q4_K: ClassVar[bool] = False
    #: whether make-model can write the architecture's MTP (NextN) block (``--mtp-agreement``)
    MTP: ClassVar[bool] = False
    #: the architecture in a few words, for ``make-model --help`` (what sets it apart)
    DESCRIPTION: ClassVar[str] = ""

    def replaced(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied (``dataclasses.replace``, kept behind the protocol)."""
        return dataclasses.replace(self, **changes)

    def refine(self, layers: int | None, keywords: dict[str, Any], options: dict[str, Any]) -> Any:
        """The preset with its architecture's own make_model ``keywords`` (those in
        :attr:`KEYWORDS` that were given) and ``options`` dict (for an architecture with ``options`` in its KEYWORDS) applied."""
        return self.replaced(**keywords) if keywords else self

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The architecture's own constraints beyond :func:`_validate` (none by default)."""

    def mtp_blocks(self) -> int:
        """MTP (NextN) blocks written after the trunk (none by default)."""
        return 0

    def default_tied(self, n_vocab: int) -> bool:
        """Tied lm head when ``--tied`` is not given: only for a large vocabulary (keeps a
        151,936-token demo model small)."""
        return n_vocab > 32768

    def write_synth_keys(self, w: Any) -> None:
        """``p2pswarm.synth.*`` keys of the architecture's own options (none by default)."""

    def write_trunk_keys(self, w: Any, n_ff: int) -> None:
        """The hyper-parameter keys every architecture but deepseek2 writes the same way
        (``w``: a gguf.GGUFWriter; ``n_ff``: feed_forward_length)."""
        w.add_context_length(self.context_length)
        w.add_embedding_length(self.n_embd)
        w.add_block_count(self.n_layer + self.mtp_blocks())
        w.add_feed_forward_length(n_ff)
        w.add_head_count(self.n_head)
        w.add_head_count_kv(self.n_head_kv)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_rope_freq_base(self.rope_freq_base)
        w.add_layer_norm_rms_eps(self.rms_eps)
        w.add_expert_count(self.n_expert)
        w.add_expert_used_count(self.n_expert_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)


def dense_types(qtype: str, expert_qtype: str | None, expert_types: tuple[str, ...] = ("q4_k",)) -> tuple[Any, Any]:
    """The gguf types of the dense tensors and of the routed experts: ``--type`` (q4_k_m is written
    F32 and quantised by llama.cpp afterwards) and ``--expert-type`` where the architecture writes
    that type directly (``expert_types``), else the experts follow ``--type``."""
    Q = _gguf().GGMLQuantizationType
    dense = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k_m": Q.F32}[qtype]
    if expert_qtype in expert_types:
        return dense, {"q4_k": Q.Q4_K, "mxfp4": Q.MXFP4}[expert_qtype]
    return dense, dense


def _file_type(qtype: str, expert_qtype: str | None) -> int:
    g = _gguf()
    F = g.LlamaFileType
    if expert_qtype == "q4_k":
        return int(F.MOSTLY_Q4_K_M)
    if expert_qtype == "mxfp4":
        return int(F.MOSTLY_MXFP4_MOE)  # by bytes the file is almost all Q4_K experts
    return int({"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0,
                "q4_k_m": F.ALL_F32}[qtype])
