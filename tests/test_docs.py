"""The documentation site (mkdocs.yml, docs/): every page short and in the nav, the API reference
covering ``moelab.__all__``, the README's links pointing at pages that exist.  The links and anchors
inside the site, and the API names mkdocstrings must find, are checked by ``make docs``
(``mkdocs build --strict``), which CI runs after ``make test``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import moelab

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the longest a hand-written page may be: one page answers one question (docs/architecture.md,
#: "Adding a page to these docs")
MAX_LINES = 300
#: pages allowed over MAX_LINES, each with the reason; none today
LONG_PAGES: dict[str, str] = {}


def pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def nav_pages(entries) -> list[str]:
    """Every page path of mkdocs.yml's nav (a list of paths, ``{title: path}`` and ``{title: [...]}``)."""
    found = []
    for entry in entries:
        if isinstance(entry, str):
            found.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                found += [value] if isinstance(value, str) else nav_pages(value)
    return found


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_every_page_is_in_the_nav_once_and_every_nav_entry_is_a_page(config):
    nav = nav_pages(config["nav"])
    assert sorted(set(nav) - set(pages())) == []  # a nav entry without its page
    assert sorted(set(pages()) - set(nav)) == []  # a page nobody can reach from the nav
    assert sorted(p for p in set(nav) if nav.count(p) > 1) == []


def test_the_build_is_strict_and_fails_on_broken_links_anchors_and_pages_left_out(config):
    assert config["strict"] is True
    assert config["validation"]["links"] == {
        "not_found": "warn",
        "anchors": "warn",
        "absolute_links": "warn",
        "unrecognized_links": "warn",
    }
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    assert config["theme"]["font"] is False  # no web fonts fetched: the site builds and reads offline


@pytest.mark.parametrize("page", pages())
def test_no_hand_written_page_is_over_300_lines(page):
    lines = len((DOCS / page).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES or page in LONG_PAGES, (
        f"docs/{page} has {lines} lines (at most {MAX_LINES}): split it by question "
        "(docs/architecture.md, 'Adding a page to these docs')"
    )


def test_every_public_name_is_in_the_api_reference():
    directives = set()
    for page in (DOCS / "reference").glob("*.md"):
        directives |= set(re.findall(r"^::: (\S+)$", page.read_text(encoding="utf-8"), flags=re.M))
    missing = []
    for name in moelab.__all__:
        obj = getattr(moelab, name)
        canonical = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if f"moelab.{name}" not in directives and canonical not in directives:
            missing.append(name)
    assert missing == []


def test_the_readme_links_only_pages_that_exist_and_reaches_the_question_pages():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert [t for t in targets if not (ROOT / t).is_file()] == []
    for page in ("quickstart", "which-router", "scaling", "results", "stats", "performance", "errors"):
        assert f"docs/{page}.md" in targets
    assert len(readme.splitlines()) <= 60  # the first five minutes; the rest is in the site


def test_every_docs_page_the_code_and_its_messages_name_exists():
    """Error messages, docstrings and comments send readers to ``docs/<page>.md``: a page that moves
    takes those pointers with it."""
    named = {}
    for folder in ("src", "tests", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.is_file():
                for page in re.findall(r"docs/([\w./-]+?\.md)", path.read_text(encoding="utf-8")):
                    named.setdefault(page, path.relative_to(ROOT).as_posix())
    for name in ("Makefile", "README.md", "mkdocs.yml", ".ci/run"):
        for page in re.findall(r"docs/([\w./-]+?\.md)", (ROOT / name).read_text(encoding="utf-8")):
            named.setdefault(page, name)
    assert {page: where for page, where in named.items() if not (DOCS / page).is_file()} == {}
