"""Errors sorted by whose fault they are (p2pswarm/errors.py): the CLI's exit code and line, and
the HTTP status a request gets when a peer fails it."""
from __future__ import annotations

import httpx
import pytest
import trio

from p2pswarm.backbone.api.http_api import CompletionsApp, serve_http
from p2pswarm.backbone.sessions.local import open_backbone
from p2pswarm.cli import _one_line
from p2pswarm.engine.text.tokenizer import Tokenizer
from p2pswarm.errors import (FrameError, InternalError, ModelFormatError, PeerError, SwarmError, UserError,
                             WorkerError)
from p2pswarm.net.libp2p.patches import PatchError


def test_kinds():
    assert issubclass(ModelFormatError, UserError)
    for cls in (WorkerError, FrameError):
        assert issubclass(cls, PeerError) and not issubclass(cls, UserError)
    assert issubclass(PatchError, InternalError) and not issubclass(PatchError, UserError)
    assert all(issubclass(c, SwarmError) for c in (UserError, PeerError, InternalError))


@pytest.mark.parametrize("exc, code", [(UserError("bad flag"), 2), (WorkerError("it died", peer="12D3KooWx"), 1),
                                       (PatchError("py-libp2p lacks X"), 1)])
def test_cli_exit_codes_and_one_line(exc, code, capsys):
    assert _one_line("node", exc) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("p2pswarm node: error: ")
    if isinstance(exc, PeerError):
        assert "12D3KooWx" in err


@pytest.mark.slow
async def test_a_peer_failure_is_a_502(tiny_f32):
    """A worker that fails with no fallback allowed: the request was fine, so not a 400."""
    async with open_backbone(tiny_f32, workers=2, transport="inproc", fallback=False) as swarm:
        for owner in swarm.owners:
            async def broken(*a, _name=owner.name, **k):
                raise WorkerError(f"{_name} is broken", peer=_name)
            owner.worker.compute_async = broken
        app = CompletionsApp(swarm.backbone, Tokenizer.from_gguf(tiny_f32), "tiny", swarm.fingerprint,
                             model_path=tiny_f32)
        got = {}
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, "127.0.0.1", 0)
            base = binds[0].replace("0.0.0.0", "127.0.0.1")

            def client():
                with httpx.Client(base_url=base, timeout=60) as c:
                    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                    got["status"], got["body"] = r.status_code, r.json()
            try:
                with trio.fail_after(120):
                    await trio.to_thread.run_sync(client)
            finally:
                nursery.cancel_scope.cancel()
    assert got["status"] == 502, got
    assert "broken" in got["body"]["error"]["message"]
