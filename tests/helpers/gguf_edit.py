"""Edited copies of a GGUF for tests: a key or tensors dropped, keys added or replaced.

Why: the refusal tests need files that miss exactly one thing, and the dense-layer tests a model
whose first layers have no routed experts; both start from a model make-model wrote."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFReader, GGUFWriter

from p2pswarm.model.gguf_read import field_value


def rewrite(src: Path, dst: Path, *, drop_key: str | None = None, drop_tensor: str | Callable[[str], bool] | None = None,
            set_keys: dict | None = None, replace_tensor: dict | None = None) -> Path:
    """A copy of ``src`` at ``dst`` without key ``drop_key`` and without tensor ``drop_tensor`` (a
    name, or a predicate on names), with ``set_keys`` (``{key: (value, type, sub type)}``) added or
    replacing the file's; ``replace_tensor`` ``{name: float32 array}``: that tensor's data (and shape)
    replaced."""
    drop = drop_tensor if callable(drop_tensor) else (lambda name: name == drop_tensor)
    r = GGUFReader(src)
    w = GGUFWriter(dst, field_value(r.fields["general.architecture"]))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key) or key in (set_keys or {}):
            continue
        w.add_key_value(key, field_value(f), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for key, (value, vtype, sub) in (set_keys or {}).items():
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        if replace_tensor and t.name in replace_tensor:
            w.add_tensor(t.name, np.asarray(replace_tensor[t.name], dtype=np.float32))
        elif not drop(t.name):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
