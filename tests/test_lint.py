"""ruff (configured in pyproject.toml: pyflakes' checks and unused noqa) over the whole tree finds
nothing; tests share code only through tests/helpers/; every import follows the layer order
docs/architecture.md draws, between p2pswarm's packages, between the folders of net/, engine/ and
backbone/, and between the modules of each of backbone's folders; no import cycle
anywhere in p2pswarm, lazy imports included (and the checks that say so catch what they forbid)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "p2pswarm", "tests", "bench", "native"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/ (or conftest.py): a test module importing another
    one runs that module's fixtures and module-level set-up twice, and couples unrelated tests."""
    import re

    offenders = [f"{p.name}:{i}: {line.strip()}" for p in sorted((REPO / "tests").glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.match(r"\s*(from|import) test_\w+", line)]
    assert not offenders, offenders


# -- the layer order ------------------------------------------------------------------------------
# docs/architecture.md draws it ("The layers"): a fenced block, top layer first, units of one layer
# separated by "|", anything after two spaces a comment. A unit is a subpackage of p2pswarm or one of
# its top-level modules. A module may import its own unit and any unit of a lower layer; never a
# unit of its own layer or above. Function-level (lazy) imports count: a lazy import is still a
# dependency, only a cheaper one.
ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_order(doc: Path = ARCHITECTURE, heading: str = "## The layers") -> list[list[str]]:
    """The layers as docs/architecture.md draws them under ``heading`` (its first fenced block), top first."""
    import re

    text = doc.read_text()
    section = text.split("\n" + heading + "\n", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        picture = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if picture:
            layers.append([u.strip() for u in picture.split("|")])
    return layers


def _unit(module: str, package: str) -> str | None:
    """The unit (subpackage or top-level module of ``package``) a dotted module name belongs to."""
    parts, pkg = module.split("."), package.split(".")
    if parts[:len(pkg)] != pkg or len(parts) <= len(pkg):
        return None
    return parts[len(pkg)]


def _imported_modules(tree, module: str, is_package: bool):
    """(line, dotted name) of every import in ``tree`` (module-level or not); ``from X import a``
    yields X.a too, since ``a`` may be a module (``from p2pswarm import settings``)."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}"


def layer_violations(root: Path, layers: list[list[str]], package: str = "p2pswarm") -> list[str]:
    """Every import under ``root/package`` that goes up the layer order or sideways to another unit
    of the same layer; also every unit the picture does not place."""
    import ast

    rank = {u: i for i, layer in enumerate(layers) for u in layer}  # 0 = top
    out, seen = [], set()
    folder = root.joinpath(*package.split("."))
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root)
        is_package = path.name == "__init__.py"
        module = ".".join(rel.with_suffix("").parts[:-1] if is_package else rel.with_suffix("").parts)
        src = _unit(module, package)
        if src is None:
            continue
        if src not in rank:
            out.append(f"{rel}: unit {src!r} is not in the layer picture")
            continue
        for line, name in _imported_modules(ast.parse(path.read_text(), str(rel)), module, is_package):
            dst = _unit(name, package)
            if dst is None or dst == src or (dst not in rank and not (folder / dst).exists()
                                                 and not (folder / f"{dst}.py").exists()):
                continue  # outside the package, own unit, or a name imported from a module
            if (rel, line, dst) in seen:
                continue  # one report per import statement
            seen.add((rel, line, dst))
            if dst not in rank:
                out.append(f"{rel}:{line}: imports {name}, whose unit {dst!r} is not in the layer picture")
            elif rank[dst] <= rank[src]:
                how = "its own layer" if rank[dst] == rank[src] else "a higher layer"
                out.append(f"{rel}:{line}: {src} imports {name} ({dst}: {how})")
    return sorted(out)


def test_imports_follow_the_layer_order():
    layers = layer_order()
    assert len(layers) > 5 and ["cli"] == layers[0], layers
    problems = layer_violations(REPO, layers)
    assert not problems, "\n".join(problems)


def test_layer_check_catches_an_upward_import(tmp_path):
    """The check itself: on a copy of the tree with one upward import (model -> net) and one
    sideways import (worker -> relay) added, it reports both and nothing else."""
    import shutil

    shutil.copytree(REPO / "p2pswarm", tmp_path / "p2pswarm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp_path / "p2pswarm" / "model" / "upward.py").write_text(
        "def f():\n    from p2pswarm.net.signed.records import NodeRecord\n    return NodeRecord\n")
    (tmp_path / "p2pswarm" / "worker" / "sideways.py").write_text("import p2pswarm.relay.service\n")
    problems = layer_violations(tmp_path, layer_order())
    assert len(problems) == 2, problems
    assert problems[0].startswith("p2pswarm/model/upward.py:2: model imports p2pswarm.net.signed.records (net: a higher"), problems
    assert problems[1].startswith("p2pswarm/worker/sideways.py:1: worker imports p2pswarm.relay.service (relay: its own"), problems


# -- inside a package ----------------------------------------------------------------------------
# The same rule one level down: docs/architecture.md draws the inside of net/, engine/ and backbone/
# ("### Inside net/", ...), a unit there being one sub-folder (or one module beside them), and the
# inside of each of backbone's sub-folders ("#### Inside backbone/serving/", ...), a unit there
# being one module. Why: a package checked as one unit let its modules import each other freely
# (generate.py, runner.py and scheduler.py did, lazily), and a folder of 28 modules said nothing of
# which was above which; each sub-folder is a layer, and the check keeps it one.
MUST_BE_DRAWN = ("net", "engine", "backbone")
BACKBONE = "p2pswarm.backbone"


def inside_pictures(doc: Path = ARCHITECTURE) -> dict[str, str]:
    """folder under p2pswarm/ ("net", "backbone/serving") -> the heading of its picture."""
    import re

    return {m[1]: m[0] for m in re.finditer(r"^#{3,4} Inside (\S+)/$", doc.read_text(), re.M)}


def test_packages_follow_their_sub_layers():
    pictures = inside_pictures()
    backbone_folders = sorted(p.name for p in (REPO / "p2pswarm" / "backbone").iterdir()
                              if (p / "__init__.py").exists())
    must = set(MUST_BE_DRAWN) | {f"backbone/{f}" for f in backbone_folders}
    assert must <= set(pictures), f"no picture for: {sorted(must - set(pictures))}"
    problems = []
    for folder, heading in sorted(pictures.items()):
        layers = layer_order(heading=heading)
        assert len(layers) > 1 or "/" in folder, (folder, layers)
        problems += layer_violations(REPO, layers, package="p2pswarm." + folder.replace("/", "."))
    assert not problems, "\n".join(problems)


def test_net_check_catches_a_sideways_import(tmp_path):
    """On a copy of the tree where the shard downloader imports the DHT (a folder of its own layer),
    the check of net's folders reports it and nothing else."""
    import shutil

    shutil.copytree(REPO / "p2pswarm", tmp_path / "p2pswarm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    fetch = tmp_path / "p2pswarm" / "net" / "shards" / "fetch.py"
    fetch.write_text(fetch.read_text() + "\n\ndef _dht():\n    from p2pswarm.net.dht.kademlia import SwarmDHT\n"
                     "    return SwarmDHT\n")
    problems = layer_violations(tmp_path, layer_order(heading=inside_pictures()["net"]), package="p2pswarm.net")
    assert len(problems) == 1 and "shards imports p2pswarm.net.dht.kademlia (dht: its own layer)" in problems[0], problems


def test_backbone_check_catches_an_upward_import(tmp_path):
    """On a copy of the tree with the runner importing the scheduler lazily (what Backbone.logits
    did: one module up inside serving/) and the in-process owners importing the dispatcher's stats
    (one folder up), the checks of serving/'s modules and of backbone's folders report each, and
    nothing else."""
    import shutil

    shutil.copytree(REPO / "p2pswarm", tmp_path / "p2pswarm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    runner = tmp_path / "p2pswarm" / "backbone" / "serving" / "runner.py"
    runner.write_text(runner.read_text() + "\n\ndef _up():\n    from p2pswarm.backbone.serving.scheduler import Scheduler\n"
                      "    return Scheduler\n")
    owners = tmp_path / "p2pswarm" / "backbone" / "owners" / "local_owners.py"
    owners.write_text(owners.read_text() + "\n\ndef _up():\n    from p2pswarm.backbone.dispatch.stats import DispatchStats\n"
                      "    return DispatchStats\n")
    pictures = inside_pictures()
    inside = layer_violations(tmp_path, layer_order(heading=pictures["backbone/serving"]), package=BACKBONE + ".serving")
    assert len(inside) == 1 and "runner imports p2pswarm.backbone.serving.scheduler (scheduler: a higher" in inside[0], inside
    folders = layer_violations(tmp_path, layer_order(heading=pictures["backbone"]), package=BACKBONE)
    assert len(folders) == 1 and "owners imports p2pswarm.backbone.dispatch.stats (dispatch: a higher" in folders[0], folders


# -- no import cycle ------------------------------------------------------------------------------
# Between any two modules of p2pswarm, counting every import: module-level, function-level (lazy)
# and those under ``if TYPE_CHECKING`` (a lazy import is still a dependency, only a cheaper one; a
# type-only one is still a dependency of the reader). A cycle means neither module can be read,
# tested or replaced without the other; the usual fix is the shared part in a module below both
# (backbone/serving/items.py, backbone/serving/combine.py) or a typing.Protocol the lower module declares
# (check_fetch.Holder, local_owners.Obtainer). Importing ``a.b.c`` counts as importing ``a.b.c``,
# not its parent packages' __init__ (whose imports are checked as their own module's).

def import_graph(root: Path, package: str = "p2pswarm") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, for every module under ``root/package``."""
    import ast

    files = {}
    for path in (root / package).rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        files[".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps = graph.setdefault(module, set())
        tree = ast.parse(path.read_text(), str(path))
        for _, name in _imported_modules(tree, module, path.name == "__init__.py"):
            while name and name not in files:  # ``from m import f``: f is a name in m
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or not (the graph's strongly
    connected components of more than one module; Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycle():
    cycles = import_cycles(import_graph(REPO))
    assert not cycles, "modules that import each other (lazy imports included):\n" + "\n".join(map(" <-> ".join, cycles))


def test_cycle_check_catches_a_lazy_cycle(tmp_path):
    """On a copy of the tree where the shared types' module imports the scheduler inside a
    function (a lazy import: the scheduler imports it at module level), the check finds the cycle."""
    import shutil

    shutil.copytree(REPO / "p2pswarm", tmp_path / "p2pswarm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    items = tmp_path / "p2pswarm" / "backbone" / "serving" / "items.py"
    items.write_text(items.read_text() + "\n\ndef _lazy():\n    from p2pswarm.backbone.serving.scheduler import Scheduler\n"
                     "    return Scheduler\n")
    cycles = import_cycles(import_graph(tmp_path))
    assert len(cycles) == 1 and {"p2pswarm.backbone.serving.items", "p2pswarm.backbone.serving.scheduler"} <= set(cycles[0]), cycles


def test_only_the_p2pswarm_package_is_installed():
    """pip installs p2pswarm and its subpackages, nothing beside it: the relay service is
    p2pswarm.relay (the top-level relay/ folder holds its deployment notes, no code), so no
    top-level ``relay`` package lands in site-packages to shadow another project's."""
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(REPO), include=include)
    assert "p2pswarm.relay" in packages and "p2pswarm.net" in packages, packages
    assert all(p == "p2pswarm" or p.startswith("p2pswarm.") for p in packages), packages
    assert not list((REPO / "relay").glob("*.py")), "relay/ holds no code: the service is p2pswarm/relay"


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines():
    """One module per concept: a module that grows past 600 lines holds more than one and is split
    by concept (the package, the tests, the benches and the build backend alike)."""
    big = [f"{p.relative_to(REPO)}: {n} lines" for root in ("p2pswarm", "tests", "bench", "native")
           for p in sorted((REPO / root).rglob("*.py"))
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not big, big
