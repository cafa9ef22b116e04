"""MkDocs hooks (mkdocs.yml `hooks:`): pages that live outside docs/ join the site.

* the site's home page is the repository's README.md, its links rewritten for the site
  (`docs/usage.md` -> `usage.md`), so the front page has one source;
* benchmarks/README.md becomes the page `benchmarks.md`, and links to it from docs/ pages
  (`../benchmarks/README.md`) point there;
* a link to any other file outside docs/ (an example config, a script, a result file) would
  be dead on the site: it is shown as its text followed by the repository path in code font.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# site page -> (source file, its directory in the repository)
EXTERNAL_PAGES = {"index.md": ("README.md", ""), "benchmarks.md": ("benchmarks/README.md", "benchmarks")}
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def site_page(repo_path: str) -> str | None:
    """The site page that shows a repository file, or None when the site does not show it."""
    for page, (source, _) in EXTERNAL_PAGES.items():
        if repo_path == source:
            return page
    if repo_path.startswith("docs/") and repo_path.endswith(".md"):
        return repo_path[len("docs/"):]
    return None


def rewrite_links(markdown: str, source_dir: str, site_path: str) -> str:
    """Rewrite the relative links of a page whose source sits in the repository directory
    `source_dir` and which the site shows at `site_path`."""

    def fix(m: re.Match) -> str:
        text, href = m.group(1), m.group(2)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", href) or href.startswith("#"):
            return m.group(0)
        path, _, anchor = href.partition("#")
        repo_path = posixpath.normpath(posixpath.join(source_dir, path))
        page = site_page(repo_path)
        if page is None:
            return text if text == f"`{repo_path}`" else f"{text} (`{repo_path}`)"
        rel = posixpath.relpath(page, posixpath.dirname(site_path) or ".")
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"

    return _LINK.sub(fix, markdown)


def on_files(files, config):
    from mkdocs.structure.files import File

    for page, (source, _) in EXTERNAL_PAGES.items():
        if files.get_file_from_path(page) is None:
            files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    if src in EXTERNAL_PAGES:
        return rewrite_links(markdown, EXTERNAL_PAGES[src][1], src)
    return rewrite_links(markdown, posixpath.dirname(posixpath.join("docs", src)), src)
