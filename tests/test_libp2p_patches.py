"""p2pswarm/net/libp2p/patches.py: applied once, version-checked, its table true.

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

from p2pswarm.net.libp2p import patches as libp2p_patches
from p2pswarm.net.libp2p.kad_patches import KAD_PROTOCOL

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
    assert common.PROTOCOL_ID == kad_dht.PROTOCOL_ID == KAD_PROTOCOL == "/p2pswarm/kad/1.0.0"


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
    with pytest.raises(libp2p_patches.PatchError, match=r"Yamux\._no_such_method, which install_write_shield relies on"):
        libp2p_patches.apply()


def test_missing_constructor_attribute_is_a_clear_error(monkeypatch):
    """An attribute the library only sets in a constructor (``Class().name``) is checked by the
    names its ``__init__`` assigns: a rename fails loudly too, not as a patch writing to a dead
    attribute (a KadDHT whose raised rate limit nobody reads)."""
    libp2p_patches.check_targets()  # every real target is found
    monkeypatch.setattr(libp2p_patches, "_TARGETS", libp2p_patches._TARGETS + (
        ("libp2p.kad_dht.kad_dht", "KadDHT()._renamed_rate_max", "patch_kad"),))
    with pytest.raises(libp2p_patches.PatchError, match=r"KadDHT\(\)\._renamed_rate_max, which patch_kad relies on"):
        libp2p_patches.check_targets()


def test_every_private_library_name_the_patches_touch_is_checked():
    """Each private attribute of a py-libp2p object that our patch modules, the host, the DHT or the
    relay's HOP subclass read or write appears in the checked list, so a patch added without
    listing what it touches fails here. Ours are told apart by definition: a function defined in
    these files, or (outside the patch modules, where ``self`` is a library object) an attribute
    our own classes assign to ``self``. A private library method our HOP subclass overrides is
    listed too."""
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol

    from p2pswarm.relay.service import GatedHop

    checked = {path.rsplit(".", 1)[-1] for _, path, _ in libp2p_patches._TARGETS}
    patch_modules = ["p2pswarm/net/libp2p/stream_patches.py", "p2pswarm/net/libp2p/host_patches.py",
                     "p2pswarm/net/libp2p/kad_patches.py"]
    users = ["p2pswarm/net/libp2p/host.py", "p2pswarm/net/dht/kademlia.py", "p2pswarm/relay/service.py"]
    trees = {path: ast.parse((REPO / path).read_text()) for path in patch_modules + users}
    ours = {n.name for tree in trees.values() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    ours |= {n.attr for path in users for n in ast.walk(trees[path]) if isinstance(n, ast.Attribute)
             and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    unlisted = {}
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                    and not n.attr.startswith("_p2pswarm") and n.attr not in ours | checked):
                unlisted.setdefault(n.attr, f"{path}:{n.lineno}")
    overrides = {name for name, value in vars(GatedHop).items() if name.startswith("_") and not name.startswith("__")
                 and callable(value) and hasattr(CircuitV2Protocol, name)}
    assert overrides and overrides <= checked, sorted(overrides - checked)
    assert not unlisted, f"private names used but not in libp2p_patches._TARGETS: {unlisted}"


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
