"""MkDocs hooks (mkdocs.yml `hooks:`): pages that live outside docs/ join the site.

* the site's home page is the repository's README.md, its links rewritten for the site
  (`docs/usage.md` -> `usage.md`), so the front page has one source;
* benchmarks/README.md becomes the page `benchmarks.md`, and links to it from docs/ pages
  (`../benchmarks/README.md`) point there;
* a link to any other file outside docs/ (an example config, a script, a result file) would
  be dead on the site: it is shown as its text followed by the repository path in code font;
* an image outside docs/ (a committed benchmark plot) is copied into the site at its
  repository path, and the image link is pointed at that copy.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# site page -> (source file, its directory in the repository)
EXTERNAL_PAGES = {"index.md": ("README.md", ""), "benchmarks.md": ("benchmarks/README.md", "benchmarks")}
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


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
        if _EXTERNAL.match(href) or href.startswith("#"):
            return m.group(0)
        path, _, anchor = href.partition("#")
        repo_path = posixpath.normpath(posixpath.join(source_dir, path))
        page = site_page(repo_path)
        if page is None:
            return text if text == f"`{repo_path}`" else f"{text} (`{repo_path}`)"
        rel = posixpath.relpath(page, posixpath.dirname(site_path) or ".")
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"

    return _LINK.sub(fix, markdown)


def outside_images(markdown: str, source_dir: str) -> list[str]:
    """Repository paths of the images a page shows that live outside docs/ (the site must copy them)."""
    paths = []
    for m in _IMAGE.finditer(markdown):
        repo_path = posixpath.normpath(posixpath.join(source_dir, m.group(2)))
        if not _EXTERNAL.match(m.group(2)) and not repo_path.startswith(("docs/", "../")) and repo_path not in paths:
            paths.append(repo_path)
    return paths


def rewrite_images(markdown: str, source_dir: str, site_path: str) -> str:
    """Point a page's images at their place in the site: a docs/ image at its page's path, one
    outside docs/ at its copy, which sits in the site at its repository path."""

    def fix(m: re.Match) -> str:
        alt, href = m.group(1), m.group(2)
        repo_path = posixpath.normpath(posixpath.join(source_dir, href))
        if _EXTERNAL.match(href) or repo_path.startswith("../"):
            return m.group(0)
        in_site = repo_path.removeprefix("docs/")
        return f"![{alt}]({posixpath.relpath(in_site, posixpath.dirname(site_path) or '.')})"

    return _IMAGE.sub(fix, markdown)


def on_files(files, config):
    from mkdocs.structure.files import File

    images: list[str] = []
    for page, (source, source_dir) in EXTERNAL_PAGES.items():
        text = (ROOT / source).read_text()
        if files.get_file_from_path(page) is None:
            files.append(File.generated(config, page, content=text))
        images += outside_images(text, source_dir)
    for path in sorted((ROOT / "docs").rglob("*.md")):
        rel = path.relative_to(ROOT).parent.as_posix()
        images += outside_images(path.read_text(), rel)
    for repo_path in dict.fromkeys(images):
        if files.get_file_from_path(repo_path) is None and (ROOT / repo_path).is_file():
            files.append(File.generated(config, repo_path, abs_src_path=str(ROOT / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    source_dir = EXTERNAL_PAGES[src][1] if src in EXTERNAL_PAGES else posixpath.dirname(posixpath.join("docs", src))
    return rewrite_images(rewrite_links(markdown, source_dir, src), source_dir, src)
