"""Tensors out of a GGUF as float32 numpy arrays, and the bounded cache that holds dequantised ones.

F32 tensors are returned as zero-copy views of the memory-mapped file (they cost no cache memory).
Every other type (F16, BF16, Q8_0, Q4_K, Q6_K, ...) is dequantised with `gguf.quants` on first use.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, quants

from p2pswarm.errors import ModelFormatError

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.MXFP4,  # gpt-oss experts
}


def to_float32(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], name: str = "") -> np.ndarray:
    """Raw tensor bytes/values as they lie in the file -> float32 array of ``shape`` (numpy order)."""
    if ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type not in SUPPORTED_TYPES:
        raise ModelFormatError(f"tensor {name}: weight type {ggml_type.name} is not supported")
    if ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    return np.ascontiguousarray(quants.dequantize(raw, ggml_type), dtype=np.float32).reshape(shape)


class ByteBoundedCache:
    """A thread-safe LRU cache of numpy arrays, bounded by their total bytes.

    Arrays that are views of the memory map (F32 weights) are stored at no cost: they hold no
    private memory.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: object, make: Callable[[], object], cost: Callable[[object], int]) -> object:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item[0]
        value = make()  # outside the lock: dequantising is the slow part
        size = cost(value)
        with self._lock:
            self.misses += 1
            if key not in self._items:
                self._items[key] = (value, size)
                self.nbytes += size
            while self.nbytes > self.max_bytes and len(self._items) > 1:
                _, (_, old) = self._items.popitem(last=False)
                self.nbytes -= old
        return value
