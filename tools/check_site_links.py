"""Check that every internal link of a built site resolves: ``tools/check_site_links.py SITE``.

Reads every ``.html`` file under the site directory and follows each ``href`` and ``src`` that
stays inside the site (no scheme, no host): the target must be a built file (a directory means
its ``index.html``), and a ``#fragment`` must be an ``id`` (or an ``<a name>``) in the target
page. ``mkdocs build --strict`` checks the Markdown links of the pages; this also covers what it
does not see: links written as raw HTML, the theme's own links, images, scripts and stylesheets.
Prints one line per broken link and exits 1 if there is any.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

_LINK_ATTRIBUTES = {"href", "src"}


class _PageParser(HTMLParser):
    """Collects a page's ids and its links (with the line they are on)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in _LINK_ATTRIBUTES:
                self.links.append((self.getpos()[0], value))


def _parse(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser


def _target_file(site: Path, page: Path, url_path: str) -> Path | None:
    """The file a link's path names, or None when it is not a file of the site.

    An absolute path (the 404 page's links, served at any depth) starts at the site's root.
    """
    if not url_path:
        target = page.resolve()
    elif url_path.startswith("/"):
        target = (site / unquote(url_path).lstrip("/")).resolve()
    else:
        target = (page.parent / unquote(url_path)).resolve()
    try:
        target.relative_to(site.resolve())
    except ValueError:
        return None  # climbs out of the site
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


def check(site: Path) -> tuple[int, list[str]]:
    """The number of internal links under ``site``, and each one that does not resolve, as
    ``page:line: link (why)``."""
    pages = {path.resolve(): _parse(path) for path in sorted(site.rglob("*.html"))}
    problems: list[str] = []
    checked = 0
    for page, parsed in pages.items():
        where = page.relative_to(site.resolve())
        for line, link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue  # another site (or mailto:, data:, javascript:)
            checked += 1
            target = _target_file(site, page, parts.path)
            if target is None:
                problems.append(f"{where}:{line}: {link} (no such file in the site)")
                continue
            fragment = unquote(parts.fragment)
            if not fragment or target.suffix != ".html":
                continue
            ids = pages[target].ids if target in pages else _parse(target).ids
            if fragment not in ids:
                problems.append(f"{where}:{line}: {link} (no id {fragment!r} in that page)")
    return checked, problems


def broken_links(site: Path) -> list[str]:
    """Every internal link under ``site`` that does not resolve (see :func:`check`)."""
    return check(site)[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python tools/check_site_links.py SITE_DIR", file=sys.stderr)
        return 2
    site = Path(args[0])
    checked, problems = check(site)
    for problem in problems:
        print(problem)
    pages = sum(1 for _ in site.rglob("*.html"))
    print(f"{checked} internal links in {pages} pages under {site}: {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
