"""Build-time hooks of the docs site (mkdocs.yml): the README is the site's front page, read from the checkout.

The README is written for GitHub, where its links to the manual start with `docs/`; on the site it lives at the root
of `docs/`, so those links lose the prefix. A docs page links the README as GitHub sees it (`../README.md#…`), and
on the site that link points at the front page. Generating the front page at build time, rather than keeping a copy
in docs/, leaves one file to edit and nothing that can drift. Nothing here reaches the network.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FRONT_PAGE = "index.md"


def front_page(readme: str) -> str:
    """The README as a page at the root of docs/: `](docs/x)` links become `](x)`."""
    return re.sub(r"\]\(docs/", "](", readme)


def readme_links_to_front_page(markdown: str, src_uri: str) -> str:
    """A page's links to the README (relative to the page, out of docs/) as links to the front page."""
    depth = src_uri.count("/")  # folders between docs/ and the page
    up = "../" * (depth + 1)
    return re.sub(rf"\]\({re.escape(up)}README\.md(?=[#)])", f"]({'../' * depth}{FRONT_PAGE}", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return readme_links_to_front_page(markdown, page.file.src_uri)


def on_files(files: Files, config) -> Files:
    if files.get_file_from_path(FRONT_PAGE) is not None:
        raise SystemExit(f"docs/{FRONT_PAGE} exists, but the front page is generated from README.md: remove it")
    files.append(File.generated(config, FRONT_PAGE, content=front_page(README.read_text())))
    return files
