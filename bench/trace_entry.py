"""Run a p2pswarm module (``p2pswarm.cli`` or ``p2pswarm.net.wire.wanproxy``) with per-hop timestamps.

    python bench/trace_entry.py p2pswarm.cli node --role worker ...      (TRACE_DIR=/tmp/t)

Used by ``bench/trace_layer.py`` through ``WanSwarm(wrapper=...)``: it patches, in this process only,
the frame reader / writer, the worker's compute and the backbone's dispatcher (or, in a proxy, the
socket reads and writes and the delay line), and appends one tab-separated line per event to
``$TRACE_DIR/<module>-<pid>.tsv``: ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every
process of the machine), the event, then its fields. Diagnostics only: nothing in p2pswarm/ knows of it.
"""
from __future__ import annotations

import os
import runpy
import sys
import threading
import time

import msgpack

_lock = threading.Lock()
_out = None


def _log(*fields) -> None:
    line = "\t".join(str(f) for f in (time.monotonic(), *fields)) + "\n"
    with _lock:
        _out.write(line)


def _peek(payload: bytes) -> tuple[str, object]:
    try:
        msg = msgpack.unpackb(payload, raw=False)
        return str(msg.get("op")), msg.get("id")
    except Exception:  # diagnostics only
        return "?", None


def _patch_frames(role: str) -> None:
    import p2pswarm.net.wire.framing as framing

    orig_read = framing.FrameReader.read_frame

    async def read_frame(self):
        payload = await orig_read(self)
        if payload is not None:
            op, rid = _peek(payload)
            _log(f"{role}_in", getattr(self.stream, "peer_name", "?"), op, rid, len(payload))
        return payload

    framing.FrameReader.read_frame = read_frame
    orig_send = framing.send_frame

    async def send_frame(stream, payload, max_frame=framing.DEFAULT_MAX_FRAME):
        op, rid = _peek(payload)
        _log(f"{role}_out0", getattr(stream, "peer_name", "?"), op, rid, len(payload))
        await orig_send(stream, payload, max_frame)
        _log(f"{role}_out", getattr(stream, "peer_name", "?"), op, rid, len(payload))

    import p2pswarm.backbone.owners.libp2p_owner as lo
    import p2pswarm.backbone.owners.socket_owner as so
    import p2pswarm.worker.server as ws

    for mod in (framing, so, lo, ws):
        mod.send_frame = send_frame


def _patch_worker() -> None:
    from p2pswarm.worker.expert_worker import ExpertWorker

    orig = ExpertWorker.compute

    def compute(self, layer, rows, groups, family=None):
        _log("w_c0", layer, len(rows))
        try:
            return orig(self, layer, rows, groups, family)
        finally:
            _log("w_c1", layer, len(rows))

    ExpertWorker.compute = compute


def _patch_backbone() -> None:
    from p2pswarm.backbone.dispatch.dispatcher import Dispatcher
    from p2pswarm.backbone.serving.runner import Backbone

    orig_rg = Dispatcher.run_groups

    async def run_groups(self, layer, cur, groups, taint=None):
        _log("rg0", layer, len(cur), len(groups))
        try:
            return await orig_rg(self, layer, cur, groups, taint)
        finally:
            _log("rg1", layer, len(cur), len(groups))

    Dispatcher.run_groups = run_groups
    for name in ("_pre_batch", "_post_batch", "_output_batch"):
        orig = getattr(Backbone, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            _log(_name + "0", threading.get_ident())
            try:
                return _orig(self, *a, **kw)
            finally:
                _log(_name + "1", threading.get_ident())

        setattr(Backbone, name, wrapped)


def _patch_proxy() -> None:
    import trio

    from p2pswarm.net.wire import wanproxy

    due_of: dict = {}
    orig_sleep_until = wanproxy.sleep_until_precise
    orig_send = trio.SocketStream.send_all
    orig_recv = trio.SocketStream.receive_some

    async def sleep_until(deadline):
        due_of[trio.lowlevel.current_task()] = deadline
        await orig_sleep_until(deadline)

    def port(stream) -> int:
        try:
            return stream.socket.getpeername()[1]
        except OSError:
            return -1

    async def send_all(self, data):
        t0 = trio.current_time()  # the proxy's due times are on trio's clock
        await orig_send(self, data)
        due = due_of.pop(trio.lowlevel.current_task(), None)
        _log("p_out", port(self), len(data), t0 - due if due is not None else "")

    async def receive_some(self, max_bytes=None):
        data = await orig_recv(self, max_bytes)
        _log("p_in", port(self), len(data))
        return data

    wanproxy.sleep_until_precise = sleep_until
    trio.SocketStream.send_all = send_all
    trio.SocketStream.receive_some = receive_some


def main() -> None:
    global _out
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        # usage, not a traceback: the first argument is the module to run, the rest are its own
        print(__doc__.strip().split("\n\n")[0] + "\n\n" + __doc__.strip().split("\n\n")[1].strip())
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    tdir = os.environ.get("TRACE_DIR", "/tmp")
    role = "proxy" if module.endswith("wanproxy") else (
        "worker" if "worker" in sys.argv else "backbone" if "backbone" in sys.argv else "other")
    _out = open(os.path.join(tdir, f"{role}-{os.getpid()}.tsv"), "w", buffering=1)
    ident = sys.argv[sys.argv.index("--identity") + 1] if "--identity" in sys.argv else ""
    if ident:
        from p2pswarm.net.signed.identity import load_or_create_identity

        _log("self", load_or_create_identity(ident).peer_id_str)
    if role == "proxy":
        _patch_proxy()
    elif role in ("worker", "backbone"):
        _patch_frames("w" if role == "worker" else "bb")
        (_patch_worker if role == "worker" else _patch_backbone)()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
