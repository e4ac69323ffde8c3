"""Model fingerprints and per-tensor hashes.

The *model fingerprint* names a model in every handshake and DHT key: two nodes that disagree on it
must refuse each other. Hashing all 77 GB of a real model would make every start and every slice
take minutes, so the fingerprint hashes what distinguishes models cheaply and surely:

* the whole header (every metadata key and the tensor table: names, types, shapes, offsets), and
* a sample of every tensor's bytes: its first and last 4 KiB.

Two fine-tunes of one architecture differ in their weights everywhere, so the samples separate
them; a re-quantisation changes the tensor table. The full per-tensor sha256 (what a downloader
checks every byte against) lives in the shard files the slicer writes and, later, in the signed
manifest.
"""
from __future__ import annotations

import hashlib

from p2pswarm.model.layout import KEY_SOURCE_FINGERPRINT, ModelLayout, field_value

SAMPLE_BYTES = 4096
FINGERPRINT_VERSION = b"p2pswarm-fingerprint-v1"


def model_fingerprint(layout: ModelLayout) -> str:
    """Hex sha256 fingerprint of a full model file (see module doc). Cheap: O(number of tensors)."""
    reader = layout.reader
    h = hashlib.sha256(FINGERPRINT_VERSION)
    data_start = min((t.data_offset for t in reader.tensors), default=len(reader.data))
    h.update(reader.data[:data_start].tobytes())
    for t in reader.tensors:
        n = int(t.n_bytes)
        start = int(t.data_offset)
        head = reader.data[start : start + min(n, SAMPLE_BYTES)]
        tail = reader.data[start + max(0, n - SAMPLE_BYTES) : start + n]
        h.update(t.name.encode())
        h.update(head.tobytes())
        h.update(tail.tobytes())
    return h.hexdigest()


def source_fingerprint(layout: ModelLayout) -> str:
    """The fingerprint of the model a file belongs to: its own for a full model, the recorded
    source's for a shard or backbone file the slicer wrote."""
    f = layout.reader.fields.get(KEY_SOURCE_FINGERPRINT)
    if f is not None:
        return str(field_value(f))
    return model_fingerprint(layout)
