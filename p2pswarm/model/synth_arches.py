"""What ``make-model`` asks of an architecture (:class:`SynthPreset`) and the registry of the
architectures it writes: one line each in :data:`PRESETS_BY_ARCH`.

Adding an architecture: a module ``synth_<arch>.py`` whose preset class (a frozen dataclass on
:class:`~p2pswarm.model.synth_presets.Preset`) writes its own keys and tensors, and one line here.
:mod:`p2pswarm.model.synth` only calls the protocol: it names no architecture's class.
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping, Protocol

from p2pswarm.errors import UserError
from p2pswarm.model.synth_deepseek2 import PRESETS_DEEPSEEK2
from p2pswarm.model.synth_glm4moe import PRESETS_GLM4
from p2pswarm.model.synth_gptoss import PRESETS_GPTOSS
from p2pswarm.model.synth_qwen35moe import PRESETS_QWEN35
from p2pswarm.model.synth_qwen3moe import PRESETS
from p2pswarm.model.synth_presets import EXPERT_QTYPES, QTYPES
from p2pswarm.model.synth_tensors import TensorPlan


class SynthPreset(Protocol):
    """One architecture's preset: the trunk's shape (read by the common checks and ``--help``) and
    what only the architecture knows. :class:`~p2pswarm.model.synth_presets.Preset` gives the
    defaults of everything but :meth:`write_keys` and :meth:`plan`."""

    @property
    def n_embd(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_head_kv(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_expert(self) -> int: ...
    @property
    def n_expert_used(self) -> int: ...
    @property
    def n_ff_exp(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def expert_qtype(self) -> str | None: ...

    #: the make_model keywords only this architecture takes
    KEYWORDS: ClassVar[tuple[str, ...]]
    #: whether ``--type q4_k_m`` keeps directly written Q4_K experts instead of refusing them
    Q4_K_M_KEEPS_Q4_K: ClassVar[bool]
    #: whether make-model can write its MTP (NextN) block
    MTP: ClassVar[bool]
    #: the architecture in a few words (``make-model --help``)
    DESCRIPTION: ClassVar[str]

    def replaced(self, **changes: Any) -> SynthPreset:
        """A copy with the common overrides (``--layers``, ``--n-embd``, ...) applied."""
        ...

    def refine(self, layers: int | None, keywords: dict[str, Any], options: dict[str, Any]) -> SynthPreset:
        """The preset after its architecture's own make_model keywords and ``options`` dict."""
        ...

    def validate(self, qtype: str, expert_qtype: str | None) -> None:
        """The architecture's own constraints, each a one-line UserError."""
        ...

    def mtp_blocks(self) -> int:
        """The MTP (NextN) blocks written after the trunk (``--mtp-agreement`` needs one)."""
        ...

    def default_tied(self, n_vocab: int) -> bool:
        """Whether the lm head is tied when ``--tied`` is not given."""
        ...

    def write_keys(self, w: Any) -> None:
        """The ``<arch>.*`` hyper-parameter keys, in the order llama.cpp's converter writes them."""
        ...

    def write_synth_keys(self, w: Any) -> None:
        """The ``p2pswarm.synth.*`` keys of the architecture's own options."""
        ...

    def plan(self, n_vocab: int, qtype: str, expert_qtype: str | None, tied: bool,
             router_near_tie: bool) -> list[TensorPlan]:
        """The tensors, in file order (llama.cpp's names and shapes)."""
        ...


#: architecture -> preset name -> preset; the order is ``--arch``'s.
PRESETS_BY_ARCH: dict[str, Mapping[str, SynthPreset]] = {
    "qwen3moe": PRESETS,
    "qwen35moe": PRESETS_QWEN35,
    "gpt-oss": PRESETS_GPTOSS,
    "glm4moe": PRESETS_GLM4,
    "deepseek2": PRESETS_DEEPSEEK2,
}
ARCHES = tuple(PRESETS_BY_ARCH)
#: make-model's ``--arch`` when none is given: the registry's first line
DEFAULT_ARCH = ARCHES[0]


def taking(keyword: str) -> list[str]:
    """The architectures whose presets take make_model's ``keyword`` (``--help``, refusals)."""
    return [a for a, ps in PRESETS_BY_ARCH.items() if keyword in next(iter(ps.values())).KEYWORDS]


def resolve(preset: str, layers: int | None, overrides: dict[str, Any],
            presets: Mapping[str, SynthPreset]) -> SynthPreset:
    """The named preset with ``--layers`` and the given (non-None) overrides applied."""
    if preset not in presets:
        raise UserError(f"unknown preset {preset!r}; choose one of: {', '.join(presets)}")
    p = presets[preset]
    if layers is not None:
        overrides = {**overrides, "n_layer": layers}
    return p.replaced(**{k: v for k, v in overrides.items() if v is not None})


def validate_common(p: SynthPreset, qtype: str, expert_qtype: str | None) -> None:
    """The checks every architecture shares (types, the trunk's sizes, block multiples), each a
    one-line UserError."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    need(qtype in QTYPES, f"unknown type {qtype!r}; choose one of: {', '.join(QTYPES)}")
    need(expert_qtype in (None, *EXPERT_QTYPES),
         f"unknown expert type {expert_qtype!r}; choose one of: {', '.join(EXPERT_QTYPES)}")
    for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_layer", "n_expert",
                 "n_expert_used", "n_ff_exp", "context_length"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name.replace('n_layer', 'layers')} must be a positive integer, got {v!r}")
    need(p.n_layer <= 512, f"layers must be at most 512, got {p.n_layer}")
    need(p.n_expert <= 1024, f"n_expert must be at most 1024 (llama.cpp's limit), got {p.n_expert}")
    need(p.n_expert_used <= p.n_expert,
         f"n_expert_used ({p.n_expert_used}) must not exceed n_expert ({p.n_expert})")
    need(p.n_head % p.n_head_kv == 0,
         f"n_head ({p.n_head}) must be a multiple of n_head_kv ({p.n_head_kv})")
    need(p.head_dim % 2 == 0, f"head_dim must be even (RoPE), got {p.head_dim}")
    block = 32
    if qtype == "q4_k_m" or expert_qtype == "q4_k":
        block = 256
    elif expert_qtype == "mxfp4" and qtype in ("f32", "f16", "bf16"):
        block = 32
    elif qtype in ("f32", "f16", "bf16"):
        block = 1
    for name in ("n_embd", "n_ff_exp"):
        v = getattr(p, name)
        need(v % block == 0, f"{name} ({v}) must be a multiple of {block} for this type")
    if qtype == "q4_k_m":
        need(expert_qtype is None,
             "--type q4_k_m quantises every tensor with llama.cpp; it cannot be combined with "
             "directly written Q4_K experts (use --type f32, f16 or q8_0 for the dense tensors)")
