"""Expert input rows in the form ggml's mat-mul turns them into, made on the backbone.

Why: a worker's ggml ``mul_mat_id`` never multiplies a K-quant or Q8_0 weight by the float32 rows it
is sent: it first quantises each row to the weight type's ``vec_dot_type`` (Q8_K for the K-quants,
Q8_0 for Q8_0/Q4_0/Q5_0, Q8_1 for Q4_1/Q5_1, F16 for F16, ...) with that type's CPU ``from_float``,
then works on those bytes only. The same libggml build (the same kernel family: the handshake
checks it) run on the backbone produces the same bytes from the same rows, and ``mul_mat_id``
given a ``src1`` already of ``vec_dot_type`` uses it as it is (ggml-cpu.c and tiled.cpp: ``wdata =
src1->type == vec_dot_type ? src1->data : params->wdata``). So the rows can cross the wire in that
form: 3,504 bytes instead of 12,288 for a 3,072-wide row to Q4_K experts (Q8_K: 292 bytes a block of
256), and the worker's output is the same bits (tests/test_wire_inputs.py).

A layer takes a pre-quantised input only when its gate and up weights (both fed the same rows)
have one ``vec_dot_type`` that is not F32, and the row width is a whole number of its blocks.
"""
from __future__ import annotations

import ctypes

import numpy as np

#: Forms input rows may take instead of float32: ggml's own quantised layouts, name -> (ggml type,
#: values per block, bytes per block); each is what ggml itself turns float32 rows into before the
#: mat-mul. The expert protocol carries rows in them (p2pswarm.net.wire.expert_protocol).
INPUT_FORMS = {"q8_K": (15, 256, 292), "q8_0": (8, 32, 34), "q8_1": (9, 32, 36), "f16": (1, 1, 2),
               "bf16": (30, 1, 2)}
_FORM_OF_TYPE = {t: name for name, (t, _, _) in INPUT_FORMS.items()}
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraitsCpu(ctypes.Structure):
    # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def _traits(lib, ggml_type: int) -> _TypeTraitsCpu | None:
    fn = getattr(lib, "get_type_traits_cpu", None)
    if fn is None:  # a libggml without it: inputs stay float32
        return None
    return _TypeTraitsCpu.from_address(fn(int(ggml_type)))


def form_for(lib, weight_types, n_embd: int) -> str | None:
    """The input form (an :data:`INPUT_FORMS` name) rows for weights of ``weight_types`` (gate, up)
    are turned into by ggml, or None when they must travel as float32."""
    forms = set()
    for t in weight_types:
        tr = _traits(lib, t)
        if tr is None:
            return None
        forms.add(_FORM_OF_TYPE.get(int(tr.vec_dot_type)))
    if len(forms) != 1 or None in forms:
        return None
    form = forms.pop()
    return form if form is not None and n_embd % INPUT_FORMS[form][1] == 0 else None


class InputQuantiser:
    """Turns float32 rows into a form with this libggml's ``from_float`` of that form's type."""

    def __init__(self, lib):
        self.lib = lib
        self._fns: dict[str, _FROM_FLOAT] = {}

    def __call__(self, form: str, rows: np.ndarray) -> np.ndarray:
        """(n, E) float32 -> (n, row bytes) uint8 in ``form``, each row as ggml quantises it."""
        t, block, block_bytes = INPUT_FORMS[form]
        fn = self._fns.get(form)
        if fn is None:
            traits = _traits(self.lib, t)
            if traits is None:  # (form_for gives no form without the traits)
                raise ValueError(f"libggml has no type traits for input form {form}")
            fn = self._fns[form] = _FROM_FLOAT(traits.from_float)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n, e = rows.shape
        out = np.empty((n, e // block * block_bytes), np.uint8)
        if n:  # blocks never span rows (E is a whole number of blocks): one call for all rows
            fn(rows.ctypes.data, out.ctypes.data, n * e)
        return out
