"""README.md and docs/*.md: every link resolves, every file and test they name exists, the README stays short."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 20_000  # bytes: the first hour in the README, the rest in docs/ (issue #23)

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
TEST_REF = re.compile(r"((?:tests/)?(?:stress/)?test_\w+\.py)::(\w+)")
# A path as the pages write it: from the repository's root, a test file (from tests/), or a
# module inside the package (from lmdbcache/, as docs/architecture.md writes `store/_read.py`).
ROOTED = re.compile(r"(?:\.ci|bench|docs|lmdbcache|scripts|tests)/[\w./-]*")
TEST_FILE = re.compile(r"(?:stress/)?test_\w+\.py")
IN_PACKAGE = re.compile(r"(?:format|store|loader|tools)/\w+\.py")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a link or heading inside one is not one)."""
    return FENCE.sub("", page.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation (not _ or -) dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    counts: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+ (.+)$", prose(page), re.M):
        base = slug(heading)
        found.add(f"{base}-{counts[base]}" if base in counts else base)
        counts[base] = counts.get(base, 0) + 1
    return frozenset(found)


@cache
def defined_functions(path: Path) -> frozenset[str]:
    """The names of the functions (test functions and methods) defined in a test file."""
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    """Each relative link (and image) of the page names a file or folder that exists, and a heading that exists."""
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert broken == [], f"{page_id(page)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_file_named_in_code_exists(page):
    """Each `path` the page names in code (`lmdbcache/format/_pack.py`, `store/_read.py`, `test_codec.py`) exists."""
    missing = []
    for token in CODE.findall(page.read_text()):
        name = token.split("::")[0]
        if ROOTED.fullmatch(name):
            found = (ROOT / name).exists()
        elif TEST_FILE.fullmatch(name):
            found = (ROOT / "tests" / name).exists()
        elif IN_PACKAGE.fullmatch(name):
            found = (ROOT / "lmdbcache" / name).exists()
        else:
            continue
        if not found:
            missing.append(token)
    assert missing == [], f"{page_id(page)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_test_named_exists(page):
    """Each `test_x.py::test_name` the page cites (a guarantee's evidence) is a test defined in that file."""
    refs = TEST_REF.findall(page.read_text())
    missing = []
    for file, name in refs:
        path = ROOT / "tests" / file.removeprefix("tests/")
        if not path.exists() or name not in defined_functions(path):
            missing.append(f"{file}::{name}")
    assert missing == [], f"{page_id(page)} cites tests that do not exist: {missing}"


def test_every_guarantee_names_its_tests():
    """Each row of the guarantees table names at least one test, or says why none can exist."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| promise", "| ---"))]
    assert len(rows) > 20
    for row in rows:
        evidence = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert TEST_REF.search(evidence) or "not testable here" in evidence, row


def test_the_readme_is_short():
    """README.md holds the first hour (pitch, install, quick start, CLI, main benchmark, limits) in under 20 KB."""
    size = len((ROOT / "README.md").read_bytes())
    assert size < README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


def test_the_checks_find_what_they_look_for():
    """The patterns above match the pages as written, so an empty result means 'all good', not 'nothing seen'."""
    readme = prose(ROOT / "README.md")
    assert "docs/guarantees.md" in LINK.findall(readme)
    assert len(TEST_REF.findall((ROOT / "docs" / "guarantees.md").read_text())) > 100
    assert "quick-start" in anchors(ROOT / "README.md")
    assert "fast-batches-dsloader-and-lmdbcachecollate" in anchors(ROOT / "docs" / "usage.md")


def paragraphs(page: Path) -> list[tuple[int, str]]:
    """The page's paragraphs of prose (blank-line separated, outside fences), with the line each starts on:
    not headings, tables, list items, quotes, images, HTML or indented blocks, nor a table's caption."""
    text = page.read_text()
    for block in FENCE.findall(text):  # keep line numbers: a fence becomes as many blank lines
        text = text.replace(block, "\n" * block.count("\n"), 1)
    blocks, start, lines = [], 0, text.splitlines()
    for number, line in enumerate([*lines, ""], 1):
        if not line.strip():
            if lines[start : number - 1]:
                blocks.append((start + 1, lines[start : number - 1]))
            start = number
    found = []
    for k, (first, block) in enumerate(blocks):
        head = block[0]
        if head.startswith(("#", "|", "-", "* ", ">", "<", " ", "![")) or re.match(r"\d+\. ", head):
            continue
        if k + 1 < len(blocks) and blocks[k + 1][1][0].startswith("|") and len(block) == 1:
            continue  # a table's caption (architecture.md: "**store**: one cache directory ...")
        found.append((first, " ".join(block)))
    return found


# A paragraph of prose begins as a sentence does and ends with closing punctuation; a line lost in an edit
# leaves one that begins in lower case ("a process started that way ...") or ends mid-sentence ("... than the").
BEGINS = re.compile(r"^(?:[A-Z0-9\"'(\[`*_]|lmdbcache\b)")
ENDS = re.compile(r"[.:!?](?:[*_`)\"']*)$|\)$")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_paragraph_is_cut(page):
    """Every paragraph of prose begins like a sentence and ends with closing punctuation: none was cut in two."""
    cut = [
        f"line {line}: {text[:50]!r} ... {text[-50:]!r}"
        for line, text in paragraphs(page)
        if not BEGINS.match(text) or not ENDS.search(text.rstrip())
    ]
    assert cut == [], f"{page_id(page)} has paragraphs cut mid-sentence: {cut}"


def test_the_cut_check_finds_a_cut(tmp_path):
    """The paragraph check flags a paragraph that ends mid-sentence and one that begins mid-sentence."""
    page = tmp_path / "cut.md"
    page.write_text("Whole.\n\nEnds with the\n\nbegins here.\n\n```\nnot prose\n```\n\n- a list item\n")
    found = [t for _, t in paragraphs(page) if not BEGINS.match(t) or not ENDS.search(t)]
    assert found == ["Ends with the", "begins here."]
