"""The docs point at what is there: every link in README.md, BENCHMARKS.md and docs/ to a file of the
project resolves, to its heading where it names one, and so does every path of the project's code
they quote (`expansion_dag/...`, `bench/...`), so that a file moved or renamed is a failing test."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A quoted path into the project's own folders, with an optional test id or line after it.
QUOTED = re.compile(r"`((?:expansion_dag|expansion_dag_tests|bench|docs|\.ci)/[\w./*-]*)(?:::[\w\[\]-]+|:\d+)?`")


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    found = set()
    for line in doc.read_text().splitlines():
        if heading := re.match(r"#+\s+(.*)", line):
            text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_link_to_a_file_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not this project's to check
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_quoted_path_of_the_project_exists(doc):
    missing = [
        path for path in QUOTED.findall(doc.read_text())
        # A benchmark's results are what a run wrote on its machine, never committed.
        if not path.startswith("bench/results/") and not (any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists())
    ]
    assert missing == []


def test_the_docs_are_found():
    assert len(DOCS) > 5 and all(doc.exists() for doc in DOCS)
