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


def _heading_ids(text: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped (``-`` and ``_``
    kept), each space a hyphen, a repeated id suffixed -1, -2, ...; code fences skipped."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def test_benchmarks_headline_table_and_links_resolve():
    """docs/benchmarks.md's top table: every row a figure with its date, command and a link into the
    notebook below that lands on a heading; the scripts it names exist; the page's links resolve."""
    text = (DOCS / "benchmarks.md").read_text()
    ids = _heading_ids(text)
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in ids, anchor
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (DOCS / target).exists(), target
    table = text.split("\n## Headline figures\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0] == "| what | latest figure | goal | date | command | section |" and len(table) > 20
    for row in table[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row  # a "|" inside a cell (even in backticks) splits it on GitHub
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", cells[3]) and "](#" in cells[5], row
        for script in re.findall(r"python (bench/[\w.]+\.py)", cells[4]):
            assert (ROOT / script).exists(), (script, row)


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
