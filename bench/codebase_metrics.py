"""Codebase shape, for issue 16's before/after table: modules, largest module, private
cross-package imports.

Why a script: the table in the closing note must be rerunnable on any commit
(`git stash; python bench/codebase_metrics.py`, or against a checkout of the base commit).
A "private cross-package import" is `from X import _name` where X sits in a different package
than the importer: a name its owner did not promise to keep. "Private attribute reach-ins" count
`obj._name` where ``obj`` is not ``self``/``cls``/``super()`` (another object's, or another library's,
private member, e.g. py-libp2p internals the host's workarounds touch). Duplicated blocks come from the `duplicates`
command, not from here.

Usage: python bench/codebase_metrics.py [ROOT]   (default: this checkout, the folder above bench/)
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGES = ("p2pswarm", "relay")


def _package_of(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else module


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def measure(root: Path) -> dict:
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files}
    private: list[str] = []
    reach_ins: list[str] = []
    for path in files:
        mod = _module_name(root, path)
        is_pkg = path.name == "__init__.py"
        own_pkg = mod if is_pkg else _package_of(mod)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and not (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super")):
                reach_ins.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = own_pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if not src.startswith(PACKAGES):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    if _package_of(src) != own_pkg:
                        private.append(f"{path.relative_to(root)}: {src}.{alias.name}")
    largest = max(sizes, key=sizes.get)
    return {
        "modules": len(files),
        "lines": sum(sizes.values()),
        "largest_module": largest,
        "largest_lines": sizes[largest],
        "over_600": sorted((f"{k} ({v})" for k, v in sizes.items() if v > 600)),
        "private_cross_package_imports": len(private),
        "private_imports": private,
        "private_attribute_reach_ins": len(reach_ins),
        "reach_ins": reach_ins,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent),
                    help="a checkout holding p2pswarm/ and relay/ (default: this one)")
    root = Path(ap.parse_args().root).resolve()
    if not (root / "p2pswarm").is_dir():
        sys.exit(f"codebase_metrics: {root} holds no p2pswarm/ package")
    print(json.dumps(measure(root), indent=1))
