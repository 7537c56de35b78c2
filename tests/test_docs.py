"""The docs site builds under `mkdocs build --strict`: a broken link, a missing anchor or a page left out of the nav
fails the suite, not a reader. The front page is the README (tools/mkdocs_hooks.py), so its links are checked too."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# mkdocs.yml as it is, its docs and site directories swapped for the test's: what `mkdocs build --strict` does
BUILD = """
import logging, sys
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort
logging.basicConfig(format="%(levelname)s - %(message)s")  # what the CLI prints: each warning, then the verdict
try:
    build(load_config("mkdocs.yml", docs_dir=sys.argv[1], site_dir=sys.argv[2], strict=True))
except Abort as e:
    sys.exit(f"mkdocs: {e}")
"""


def build(site: Path, docs: Path = ROOT / "docs") -> subprocess.CompletedProcess:
    """A strict build into a throwaway site directory, in its own process (mkdocs configures logging globally)."""
    return subprocess.run([sys.executable, "-c", BUILD, str(docs), str(site)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def test_the_site_builds_strictly(tmp_path):
    r = build(tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    front = (tmp_path / "site" / "index.html").read_text()
    assert 'id="the-main-job-make-run"' in front     # the README, as the front page
    assert 'src="img/main-accuracy.png"' in front      # its figure, linked as the site needs it
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="flare.config.load.config_reference"' in api  # a function's docstring, rendered by mkdocstrings


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The same configuration over a copy of docs/ with one broken anchor and one link to a missing page."""
    docs = shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = docs / "models.md"
    page.write_text(page.read_text() + "\n[a heading that is not there](method.md#no-such-heading) "
                    "and [a page that is not there](no-such-page.md)\n")
    r = build(tmp_path / "site", docs)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "'method.md#no-such-heading'" in out and "'no-such-page.md'" in out, out


def _hooks():
    import importlib.util
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_links_between_the_readme_and_the_manual_work_on_github_and_on_the_site():
    """The README links `docs/x.md` (GitHub's view); on the site it is docs/index.md, so the prefix goes. A page links
    the README as `../README.md` (GitHub's view); on the site that is the front page."""
    hooks = _hooks()
    assert hooks.front_page("[m](docs/method.md#x) ![f](docs/img/a.png) [r](results.md)") == \
        "[m](method.md#x) ![f](img/a.png) [r](results.md)"
    assert hooks.readme_links_to_front_page("[q](../README.md#quickstart)", "getting-started.md") == \
        "[q](index.md#quickstart)"
    assert hooks.readme_links_to_front_page("[q](../../README.md)", "results/index.md") == "[q](../index.md)"
    # a README elsewhere (another folder's) is left alone
    assert hooks.readme_links_to_front_page("[q](../README.md)", "results/index.md") == "[q](../README.md)"
