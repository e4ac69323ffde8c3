"""Where everything is in a MoE GGUF: hyper-parameters and the byte range of every routed expert.

The whole design rests on one fact of the GGUF format: a routed-expert tensor
(``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``) stores the expert index in ne[2], the
outermost dimension. So expert ``e`` of such a tensor is one contiguous slab of bytes,
``[data_offset + e * nb2, data_offset + (e + 1) * nb2)``, aligned to quantisation blocks. A slice
of experts is a byte-range copy, whatever the quantisation type.

Nothing here is specific to one architecture: qwen3moe, qwen2moe, qwen35moe, olmoe and
mixtral-as-llama all name and lay out their experts the same way. :data:`MOE_ARCHITECTURES` is the
allow-list of architectures we have checked, so an unknown one fails loudly instead of being
silently mis-read.

The file is memory-mapped by :class:`gguf.GGUFReader`; nothing here reads tensor data.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader

from p2pswarm.contracts import SWIGLU, SWIGLU_OAI
from p2pswarm.errors import ModelFormatError, UserError
# The GGUF reader and its helpers live in gguf_read; importable from here as before.
from p2pswarm.model.gguf_read import field_value, get_str, open_gguf
from p2pswarm.model.split_gguf import GGUFPart, PartMap, SplitGGUFReader, is_split

#: The GGUF architectures whose routed experts follow the layout above, and what each expert
#: computes (:mod:`p2pswarm.engine.experts.expert_fn`): what a worker needs to serve a file's
#: experts, with no dense path (four of these have none here). Why here and not in the engine's
#: registry of architectures: the expert banks sit below it (the engine's layer picture), and
#: what an expert is, is a fact of the file format, like where its bytes are.
MOE_ARCHITECTURES = {"qwen3moe": SWIGLU, "qwen35moe": SWIGLU, "qwen2moe": SWIGLU, "olmoe": SWIGLU, "llama": SWIGLU,
                     "mixtral": SWIGLU, "gpt-oss": SWIGLU_OAI, "glm4moe": SWIGLU, "deepseek2": SWIGLU}

# `blk.<layer>.ffn_<kind>_exps.<weight|bias>`; kind "gate_up" is the fused gate+up tensor
# (gate rows first) some architectures use.
EXPERT_TENSOR_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)$")

# Keys our own tools add to the files they write.
KEY_SHARD_KIND = "p2pswarm.shard.kind"  # "experts" | "backbone"
#: What each kind of slice is, in words (error messages).
SHARD_KIND_NAMES = {"experts": "an expert shard", "backbone": "a backbone file"}
KEY_SOURCE_FINGERPRINT = "p2pswarm.source.fingerprint"
KEY_LAYER_BEGIN = "p2pswarm.shard.layer_begin"
KEY_LAYER_END = "p2pswarm.shard.layer_end"  # exclusive
KEY_EXPERT_BEGIN = "p2pswarm.shard.expert_begin"
KEY_EXPERT_END = "p2pswarm.shard.expert_end"  # exclusive
KEY_TENSOR_NAMES = "p2pswarm.shard.tensor_names"
KEY_TENSOR_SHA256 = "p2pswarm.shard.tensor_sha256"
# A backbone file's record of the source model's header (base64) and size: what the routed experts
# it lacks look like, so a backbone started from it can lay out, fetch and compute them
# (p2pswarm.model.expert_store).
KEY_SOURCE_HEADER = "p2pswarm.source.header_b64"
KEY_SOURCE_FILE_SIZE = "p2pswarm.source.file_size"


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor of one layer, as it lies in the file."""

    layer: int
    kind: str  # "gate" | "up" | "down" | "gate_up"
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (n_expert_in_file, rows, cols)
    data_offset: int  # absolute byte offset of the tensor in the file
    nbytes: int
    expert_nbytes: int  # nb2: bytes of one expert's slab

    @property
    def n_expert(self) -> int:
        return self.shape[0]

    def slab(self, local_index: int) -> tuple[int, int]:
        """(absolute offset, length) of one expert's bytes, by index within this file."""
        if not 0 <= local_index < self.n_expert:
            raise IndexError(f"{self.name}: expert index {local_index} outside 0..{self.n_expert - 1}")
        return self.data_offset + local_index * self.expert_nbytes, self.expert_nbytes

    def slabs(self, begin: int, end: int) -> tuple[int, int]:
        """(absolute offset, length) of experts [begin, end) by index within this file: contiguous."""
        return self.data_offset + begin * self.expert_nbytes, (end - begin) * self.expert_nbytes


@dataclass
class ModelLayout:
    """The map of one GGUF: a full model, an expert shard or a backbone file."""

    path: Path
    reader: GGUFReader
    arch: str
    hparams: dict[str, Any]  # `{arch}.*` keys, prefix stripped
    n_layer: int
    n_expert: int  # experts per layer in the *source model*
    n_expert_used: int
    expert_tensors: dict[int, dict[str, ExpertTensor]] = field(default_factory=dict)
    # For a shard: the global id of the first expert stored here and the layers it holds.
    expert_begin: int = 0
    expert_end: int = 0
    shard_kind: str | None = None
    file_size: int = 0
    # Where the bytes are: one file, or the parts of a split model (see split_gguf). Offsets
    # everywhere else (tensors, expert slabs, manifests) are those of the one (merged) file.
    part_map: PartMap | None = None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, require_experts: bool = True, reader: GGUFReader | None = None,
             file_size: int | None = None) -> "ModelLayout":
        """Map a GGUF file, or a split model named by its first part (the other parts are found
        by name, as llama.cpp finds them: see split_gguf). ``reader``/``file_size`` describe a model
        known only by its header bytes (a downloader builds its shard's header before holding any
        tensor: see slicer.header_layout)."""
        path = Path(path)
        if reader is None:
            reader = open_gguf(path)
            if is_split(reader):
                reader = SplitGGUFReader(path, reader, open_gguf)
        if isinstance(reader, SplitGGUFReader):
            file_size, part_map = reader.file_size, reader.part_map
        else:
            file_size = path.stat().st_size if file_size is None else file_size
            part_map = PartMap([GGUFPart(path, reader.data, file_size)])
        arch = get_str(reader, "general.architecture")
        if arch is None:
            raise ModelFormatError(f"{path}: no general.architecture key: not a model GGUF")
        if arch not in MOE_ARCHITECTURES:
            raise ModelFormatError(
                f"{path}: unknown architecture {arch!r} (known MoE architectures: {', '.join(MOE_ARCHITECTURES)})"
            )
        hparams = {
            k[len(arch) + 1 :]: field_value(f) for k, f in reader.fields.items() if k.startswith(arch + ".")
        }
        n_layer = int(hparams.get("block_count", 0))
        n_expert = int(hparams.get("expert_count", 0) or 0)
        n_used = int(hparams.get("expert_used_count", 0) or 0)
        shard_kind = get_str(reader, KEY_SHARD_KIND)
        if n_layer <= 0:
            raise ModelFormatError(f"{path}: {arch}.block_count missing or zero")
        if n_expert <= 0 and require_experts and shard_kind != "backbone":
            raise ModelFormatError(f"{path}: dense model ({arch}.expert_count is missing or 0): nothing to shard")

        layout = cls(
            path=path, reader=reader, arch=arch, hparams=hparams, n_layer=n_layer, n_expert=n_expert,
            n_expert_used=n_used, shard_kind=shard_kind, file_size=file_size, part_map=part_map,
        )
        layout.expert_begin = int(field_value(reader.fields[KEY_EXPERT_BEGIN])) if KEY_EXPERT_BEGIN in reader.fields else 0
        layout.expert_end = (
            int(field_value(reader.fields[KEY_EXPERT_END])) if KEY_EXPERT_END in reader.fields else n_expert
        )
        n_in_file = layout.expert_end - layout.expert_begin
        for t in reader.tensors:
            end = t.data_offset + t.n_bytes
            if end > file_size:
                raise ModelFormatError(
                    f"{path}: truncated: tensor {t.name} ends at byte {end} but the file has {file_size}"
                )
            m = EXPERT_TENSOR_RE.match(t.name)
            if not m:
                continue
            layer, kind = int(m.group(1)), m.group(2)
            if m.group(3) == "bias":
                kind += "_bias"
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if len(shape) < 2 or shape[0] != n_in_file:
                raise ModelFormatError(
                    f"{path}: {t.name} has shape {shape}, expected {n_in_file} experts in its outermost dimension"
                )
            layout.expert_tensors.setdefault(layer, {})[kind] = ExpertTensor(
                layer=layer, kind=kind, name=t.name, ggml_type=t.tensor_type, shape=shape,
                data_offset=int(t.data_offset), nbytes=int(t.n_bytes), expert_nbytes=int(t.n_bytes) // shape[0],
            )
        if require_experts and shard_kind != "backbone" and not layout.expert_tensors:
            raise ModelFormatError(f"{path}: no routed-expert tensors (blk.N.ffn_*_exps.weight) found")
        for layer, kinds in layout.expert_tensors.items():
            has_gate_up = "gate_up" in kinds or ("gate" in kinds and "up" in kinds)
            if not has_gate_up or "down" not in kinds:
                raise ModelFormatError(
                    f"{path}: layer {layer} has expert tensors {sorted(kinds)}; need gate+up (or gate_up) and down"
                )
        return layout

    @property
    def expert_activation(self) -> str:
        """What each routed expert computes: ``swiglu``, or ``swiglu_oai`` with biases
        (:data:`MOE_ARCHITECTURES`)."""
        return MOE_ARCHITECTURES[self.arch]

    # ---- bytes ---------------------------------------------------------------------------
    @property
    def parts(self) -> list[GGUFPart]:
        """The files this model's bytes are in: one, or each part of a split model."""
        return self._bytes().parts

    def locate(self, offset: int, n: int) -> tuple[GGUFPart, int]:
        """(file, offset in it) of the model's bytes ``[offset, offset + n)`` (a tensor's range
        or part of one): what a reader of a file descriptor needs."""
        return self._bytes().locate(offset, n)

    def view(self, offset: int, n: int):
        """The model's bytes ``[offset, offset + n)`` as a uint8 view of the memory map holding
        them (no copy): what every reader of tensor bytes uses, never ``reader.data``, so a split
        model reads the right part."""
        return self._bytes().view(offset, n)

    @property
    def split(self) -> bool:
        """Whether the bytes are in several files (a split model)."""
        return self._bytes().split

    def _bytes(self) -> PartMap:
        if self.part_map is None:  # a layout built by hand (a test's routing table) has no file behind it
            raise ModelFormatError(f"{self.path}: this layout was not read from a file: it has no bytes to read")
        return self.part_map

    def header_bytes(self) -> bytes:
        """The bytes before the first tensor's data: the file's own, or for a split model those
        of the merged file (what the fingerprint and the manifest hash)."""
        if isinstance(self.reader, SplitGGUFReader):
            return self.reader.header
        data = self.reader.data
        return data[: min((int(t.data_offset) for t in self.reader.tensors), default=len(data))].tobytes()

    def field_bytes(self, f) -> bytes:
        """A metadata field's exact bytes, to copy it into another file."""
        if isinstance(self.reader, SplitGGUFReader):
            return self.reader.field_bytes(f)
        return self.reader.data[f.offset: f.offset + sum(int(p.nbytes) for p in f.parts)].tobytes()

    # ---- queries -------------------------------------------------------------------------
    @property
    def expert_layers(self) -> list[int]:
        return sorted(self.expert_tensors)

    def require_full_model(self) -> "ModelLayout":
        """UserError (one line) unless this is a full model: a backbone, `logits` or `generate`
        handed a file `p2pswarm slice` cut would otherwise fail later, on a missing tokenizer or
        missing dense weights, without saying what the file is."""
        if self.shard_kind is not None:
            what = SHARD_KIND_NAMES.get(self.shard_kind, f"a {self.shard_kind} slice")
            raise UserError(f"{self.path} is {what}, not a model: give the full model GGUF")
        return self

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self.expert_tensors and self.expert_begin <= expert < self.expert_end

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert (all its tensors) in a layer: the unit a worker holds."""
        return sum(t.expert_nbytes for t in self.expert_tensors[layer].values())

    def tensor(self, name: str):
        for t in self.reader.tensors:
            if t.name == name:
                return t
        raise ModelFormatError(f"{self.path}: required tensor {name!r} is missing")

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.reader.tensors)

    def hparam(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        if key in self.hparams:
            return self.hparams[key]
        if required:
            raise ModelFormatError(f"{self.path}: required key {self.arch}.{key} is missing")
        return default


def shard_hash(layout) -> str:
    """Hex sha256 naming a shard file's exact contents, from what the slicer recorded in it: the
    source fingerprint, the ranges, and every tensor's name and sha256. Two workers serving
    byte-identical shards have the same hash; cheap (metadata only)."""
    cached = getattr(layout, "_p2pswarm_shard_hash", None)
    if isinstance(cached, str):
        return cached
    fields = layout.reader.fields
    h = hashlib.sha256(b"p2pswarm-shard-v1\x00")
    for key in (KEY_SOURCE_FINGERPRINT, KEY_LAYER_BEGIN, KEY_LAYER_END, KEY_EXPERT_BEGIN, KEY_EXPERT_END,
                KEY_TENSOR_NAMES, KEY_TENSOR_SHA256):
        f = fields.get(key)
        h.update(key.encode() + b"=" + repr(field_value(f) if f is not None else None).encode() + b"\x00")
    out = h.hexdigest()
    try:
        layout._p2pswarm_shard_hash = out
    except (AttributeError, TypeError):
        pass
    return out
