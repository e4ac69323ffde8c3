"""p2pswarm/net/libp2p_patches.py: applied once, version-checked, its table true.

The patches' behaviour is tested where each trap shows (the table in the module doc names those
tests); here: ``apply()`` is idempotent and installs every process-wide patch, a py-libp2p
version other than the pinned one warns, a missing private target is a one-line PatchError naming
the patch, and every regression test the table names exists.
"""
from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from p2pswarm.net import libp2p_patches

REPO = Path(__file__).resolve().parent.parent


def test_apply_once_installs_every_process_wide_patch():
    from libp2p.identity.identify import identify as ident
    from libp2p.kad_dht import common, kad_dht
    from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

    libp2p_patches.apply()
    shield = Yamux._write_frame
    libp2p_patches.apply()  # a second call changes nothing
    assert Yamux._write_frame is shield and Yamux._p2pswarm_shielded
    assert YamuxStream._p2pswarm_batched_credit and YamuxStream._p2pswarm_coalesced
    from libp2p.io.trio import TrioTCPStream

    assert TrioTCPStream._p2pswarm_buffered
    assert ident._prefer_circuit_addr._p2pswarm
    assert common.PROTOCOL_ID == kad_dht.PROTOCOL_ID == libp2p_patches.KAD_PROTOCOL == "/p2pswarm/kad/1.0.0"


def test_other_libp2p_version_warns(monkeypatch, caplog):
    monkeypatch.setattr(libp2p_patches, "_applied", False)
    monkeypatch.setattr(libp2p_patches, "installed_version", lambda: "0.9.0")
    with caplog.at_level(logging.WARNING, logger="p2pswarm.net"):
        libp2p_patches.apply()
    assert any("py-libp2p 0.9.0 installed" in r.getMessage() and "0.8.1" in r.getMessage() for r in caplog.records)
    assert libp2p_patches.installed_version.__name__ == "<lambda>" and libp2p_patches._applied


def test_missing_private_target_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(libp2p_patches, "_applied", False)
    monkeypatch.setattr(libp2p_patches, "_TARGETS", libp2p_patches._TARGETS + (
        ("libp2p.stream_muxer.yamux.yamux", "Yamux._no_such_method", "install_write_shield"),))
    with pytest.raises(libp2p_patches.PatchError, match=r"Yamux\._no_such_method, which install_write_shield replaces"):
        libp2p_patches.apply()


def test_installed_libp2p_is_the_pinned_one():
    pin = re.search(r'"libp2p==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert pin and pin.group(1) == libp2p_patches.LIBP2P_VERSION == libp2p_patches.installed_version()


def test_every_regression_test_the_table_names_exists():
    doc = libp2p_patches.__doc__
    files = sorted(set(re.findall(r"tests/test_\w+\.py", doc)))
    names = set(re.findall(r"\b(test_\w*[a-z0-9])\b(?!\.py)", doc))
    assert len(files) == 3 and len(names) >= 20, (files, names)
    defs: set[str] = set()
    for path in files:
        tree = ast.parse((REPO / path).read_text())
        defs |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert not names - defs, f"named in libp2p_patches' table but not in {files}: {sorted(names - defs)}"
