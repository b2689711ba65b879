"""The documentation stays true to the repository: the config reference is the schema's,
the README stays short, and no page points at a file that is not in the checkout."""

import re
from pathlib import Path

import pytest

from posttrain import config_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")   # [text](target "title")
MD_FILE = re.compile(r"(?<![\w./-])((?:\.\./|\./)*[\w.-]+(?:/[\w.-]+)*\.md)\b")  # a .md path named in text
ESCAPE = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-]*)")                               # ../ leading anywhere


def test_the_config_reference_matches_the_schema():
    problem = config_reference.stale(ROOT / "docs" / "config.md")
    assert problem is None, problem      # names the command that rewrites it


def test_every_config_field_has_a_description():
    assert config_reference.undocumented() == [], "add description= to these fields in posttrain/config.py"


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_LINES})"


def inside(page: Path, target: str) -> Path | None:
    """The repository path `target` names from `page`, or None when it leaves the checkout."""
    path = (page.parent / target).resolve()
    return path if path == ROOT or ROOT in path.parents else None


def anchors(page: Path) -> set[str]:
    """The fragments GitHub gives a page's headings: lower case, punctuation dropped,
    spaces as hyphens (`## Seed 0 in detail` -> `seed-0-in-detail`)."""
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))   # no headings in code blocks
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"(?m)^#+ (.+)$", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository_and_exist(page):
    text = page.read_text(encoding="utf-8")
    links = [t.partition("#") for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    outside = [path for path, _, _ in links if path and inside(page, path) is None]
    assert not outside, f"{page.name} links outside the repository: {outside}; restate what is needed instead"
    missing = [path for path, _, _ in links if path and path not in outside and not inside(page, path).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"
    targets = [(inside(page, path) if path else page, fragment) for path, _, fragment in links if fragment]
    broken = [f"{target.name}#{fragment}" for target, fragment in targets
              if target.suffix == ".md" and fragment not in anchors(target)]
    assert not broken, f"{page.name} links to headings that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_file_outside_the_repository(page):
    """`../shared/DESIGN.md`, or a bare `shared/DESIGN.md`: a reader of the repository has
    neither. Every Markdown file a page names is in the checkout (from the page's folder
    or from the root)."""
    text = page.read_text(encoding="utf-8")
    escapes = [t for t in ESCAPE.findall(text) if inside(page, t) is None]
    absent = sorted({name for name in MD_FILE.findall(text)
                     if not ((page.parent / name).exists() or (ROOT / name).exists())})
    assert not escapes, f"{page.name} points outside the repository: {escapes}"
    assert not absent, f"{page.name} names Markdown files that are not in the repository: {absent}"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and f"({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link to {unlisted}"
