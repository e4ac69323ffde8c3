"""User docs hygiene: an index that lists every page, links that resolve, and no
internal jargon (the project's issue and stop numbers, "the seed's") in what a user reads."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = ROOT / "bench"
# What a user reads; benchmarks.md is a lab notebook whose entries name the work they measured.
USER_DOCS = ["README.md", "docs/README.md", "docs/quickstart.md", "docs/api.md", "docs/configuration.md",
             "docs/deploy.md", "docs/market.md"]
JARGON = re.compile(r"the seed's|\bissue (?:M?\d+[a-z]?)\b|\bstop \d+\b|\bM[0-9][a-z]?\b", re.IGNORECASE)


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name


@pytest.mark.parametrize("doc", USER_DOCS)
def test_user_doc_has_no_internal_jargon_and_its_links_resolve(doc):
    path = ROOT / doc
    text = path.read_text()
    assert not JARGON.findall(text), (doc, JARGON.findall(text))
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (path.parent / target).exists(), (doc, target)


def test_bench_readme_lists_every_script_once():
    listed = re.findall(r"\]\(([\w.]+\.py)\)", (BENCH / "README.md").read_text())
    assert sorted(listed) == sorted(p.name for p in BENCH.glob("*.py")), \
        "bench/README.md: one line per bench/*.py, linked (a retired script: in Retired, unlinked)"


def test_license_matches_the_vendored_llama_cpp_notice():
    ours = (ROOT / "LICENSE").read_text()
    theirs = (ROOT / "p2pswarm" / "data" / "LICENSE-llama.cpp").read_text()
    assert ours.startswith("MIT License") and theirs.startswith("MIT License")
    body = lambda t: t.split("Permission is hereby granted", 1)[1]
    assert body(ours) == body(theirs)
