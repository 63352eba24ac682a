#!/usr/bin/env python3
"""Checks the book: every page is in SUMMARY.md, and every internal link resolves.

    python3 docs/check_book.py [BUILT_BOOK_DIR]   (default: target/book)

mdBook builds a page that no chapter names without a word, and renders a link
to a missing page or anchor as a dead link. This fails instead:

* every .md under docs/src (but SUMMARY.md) must be a chapter of SUMMARY.md,
  and every chapter SUMMARY.md names must exist;
* in the built HTML (what a reader clicks), every relative href must name a
  file of the book, and its #fragment an id on that page. Links out of the
  book (to the repository's files) must be absolute URLs: a relative one
  would break on the published site;
* README.md's relative links must name files that exist, and headings of
  the Markdown pages they point into.

Python 3.11 standard library only. Exit status 1 on the first kind of
failure found, with every failure listed.
"""

from __future__ import annotations

import html.parser
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

DOCS = Path(__file__).resolve().parent
SRC = DOCS / "src"
# Pages mdBook writes for itself: print.html repeats every chapter with links
# rewritten to its own anchors, the others carry no content of ours.
SKIP_PAGES = {"print.html", "404.html", "toc.html"}


def summary_chapters() -> list[str]:
    text = (SRC / "SUMMARY.md").read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+\.md)\)", text)]


def check_summary() -> list[str]:
    problems = []
    listed = summary_chapters()
    for chapter in listed:
        if not (SRC / chapter).is_file():
            problems.append(f"SUMMARY.md names {chapter}, which does not exist")
    for page in sorted(SRC.rglob("*.md")):
        rel = page.relative_to(SRC).as_posix()
        if rel != "SUMMARY.md" and rel not in listed:
            problems.append(f"docs/src/{rel} is not a chapter of SUMMARY.md")
    return problems


class Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str]] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if name in ("href", "src") and value is not None:
                self.links.append((self.getpos()[0], value))


def check_built(book: Path) -> list[str]:
    if not (book / "index.html").is_file():
        return [f"{book} holds no built book (run: mdbook build docs)"]
    pages: dict[Path, Page] = {}
    for path in book.rglob("*.html"):
        parser = Page()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = parser
    problems = []
    checked = 0
    for path, page in sorted(pages.items()):
        rel_page = path.relative_to(book.resolve()).as_posix()
        if rel_page in SKIP_PAGES:
            continue
        for line, href in page.links:
            parts = urlsplit(href)
            if parts.scheme or href.startswith("//") or href.startswith("mailto:"):
                continue
            checked += 1
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{rel_page}:{line}: {href}: no such file in the book")
                continue
            fragment = unquote(parts.fragment)
            if fragment and target.suffix == ".html":
                if fragment not in pages[target.resolve()].ids:
                    problems.append(f"{rel_page}:{line}: {href}: no anchor #{fragment} there")
    if checked == 0:
        problems.append("no internal link found: is this the built book?")
    return problems


def heading_ids(page: Path) -> set[str]:
    """The ids mdBook (and GitHub) give a Markdown page's headings."""
    ids, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"#+ (.*)", line)
        if match:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
            ids.add("".join(c.lower() if c.isalnum() or c in "_-" else "-" for c in text.strip()
                            if c.isalnum() or c in "_-" or c.isspace()))
    return ids


def check_readme() -> list[str]:
    """README.md's relative links (into the book's sources) name files and headings that exist."""
    readme = DOCS.parent / "README.md"
    problems = []
    for number, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), 1):
        for href in re.findall(r"\]\(([^)\s]+)\)", line):
            parts = urlsplit(href)
            if parts.scheme or href.startswith("//"):
                continue
            target = (readme.parent / unquote(parts.path)).resolve() if parts.path else readme
            if not target.exists():
                problems.append(f"README.md:{number}: {href}: no such file")
            elif parts.fragment and target.suffix == ".md" and parts.fragment not in heading_ids(target):
                problems.append(f"README.md:{number}: {href}: no heading #{parts.fragment} there")
    return problems


def main() -> int:
    book = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS.parent / "target" / "book"
    problems = check_summary() + check_built(book) + check_readme()
    for problem in problems:
        print(f"book: {problem}", file=sys.stderr)
    if problems:
        print(f"book: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"book: every page is in SUMMARY.md and every internal link of {book} resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
