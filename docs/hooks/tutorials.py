"""mkdocs hook: the tutorial notebooks on the site, with their outputs, offline, and with a link to their source.

The notebooks live in ``tutorials/`` at the repository root and are committed without outputs. CI executes them
into ``build/tutorials/`` (``.ci/run``; ``DSPARK_EXECUTED_ROOT`` replaces ``build``); this hook adds each notebook
to the site as ``tutorials/<name>.ipynb``,
taking the executed copy when it is current (same cells as the source) and the source otherwise, and
mkdocs-jupyter renders it. ``DSPARK_REQUIRE_NOTEBOOK_OUTPUTS=1`` (set by CI) turns a missing or stale executed
copy into a build error, so the published site always shows outputs.

On each rendered notebook page the hook also

* puts a banner on top: where the source is, how to run it, a download of the notebook with its outputs, and a
  link into the repository when ``extra.repository_url`` is configured (``DSPARK_REPOSITORY_URL``);
* removes the MathJax and Mermaid ``<script>`` tags that nbconvert's template points at a CDN: the site renders
  notebook math with its own vendored KaTeX (docs/assets/javascripts/math.js), so no request leaves the site;
* rewrites links written for Jupyter (``../docs/method.md#…``, ``02_drafter.ipynb``) into site links, and fails the
  build when one points at a page that does not exist.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.tutorials")

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "tutorials"
SITE_DIR = "tutorials"  # where the notebooks sit in the site (next to the tutorials.md overview) and in a checkout
EXECUTED_DIR = Path(os.environ.get("DSPARK_EXECUTED_ROOT", ROOT / "build")) / SITE_DIR

_CDN_SCRIPTS = [
    re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", flags=re.S),
    re.compile(r"<script[^>]*src=\"https?://[^\"]*\"[^>]*>\s*</script>", flags=re.S),
    re.compile(r"<script type=\"module\">(?:(?!</script>).)*?https?://(?:(?!</script>).)*</script>", flags=re.S),
]
_HREF = re.compile(r'href="(?P<url>[^"#:]+\.(?:md|ipynb))(?P<anchor>#[^"]*)?"')


def _cells(path: Path) -> list[tuple[str, str]]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def _has_outputs(path: Path) -> bool:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def notebook_to_render(source: Path) -> Path:
    """The executed copy of ``source`` if it exists and holds the same cells, else ``source`` itself."""
    executed = EXECUTED_DIR / source.name
    current = executed.is_file() and _cells(executed) == _cells(source) and _has_outputs(executed)
    if current:
        return executed
    why = "is stale (its cells differ from the source)" if executed.is_file() else "does not exist"
    if os.environ.get("DSPARK_REQUIRE_NOTEBOOK_OUTPUTS") == "1":
        raise PluginError(f"tutorials: executed copy {executed} {why}; execute the notebooks first (see .ci/run)")
    log.info("tutorials: %s %s; rendering %s without outputs", executed, why, source.name)
    return source


@event_priority(100)  # before mkdocs-jupyter turns the .ipynb files into pages
def on_files(files, config):
    for source in sorted(SOURCE_DIR.glob("*.ipynb")):
        uri = f"{SITE_DIR}/{source.name}"
        if files.get_file_from_path(uri) is not None:
            raise PluginError(f"tutorials: {uri} exists under docs/; the notebooks live in tutorials/ only")
        # A plain File rooted two levels up (<root>/tutorials/<name>.ipynb), not File.generated: mkdocs-jupyter wraps
        # the file and reads its path from src_dir, which a generated file does not have.
        path = notebook_to_render(source)
        files.append(File(uri, str(path.parent.parent), config["site_dir"], config["use_directory_urls"]))
    return files


def on_config(config):
    url = config["extra"].get("repository_url")
    if url:
        config["nav"].append({"Repository": url})
    return config


def _banner(page, config, files) -> str:
    name = posixpath.basename(page.file.src_uri)
    overview = files.get_file_from_path("tutorials.md").url_relative_to(page.file)
    url = config["extra"].get("repository_url")
    repo = f' · <a href="{url.rstrip("/")}/blob/main/tutorials/{name}">view it in the repository</a>' if url else ""
    return (
        '<div class="admonition tip dspark-notebook-source"><p class="admonition-title">Run it yourself</p>'
        f"<p>Source: <code>tutorials/{name}</code>{repo}. Run it with <code>jupyter lab tutorials/{name}</code> "
        f'after <code>pip install -e ".[notebooks]"</code> (see <a href="{overview}">Tutorials</a>), or '
        f'<a href="{name}" download>download it with the outputs shown here</a>.</p></div>'
    )


def _rewrite_links(html: str, page, files) -> str:
    """Links written for Jupyter (relative to tutorials/) -> links between site pages."""

    def repl(m: re.Match) -> str:
        url, anchor = m["url"], m["anchor"] or ""
        if url.startswith("../docs/"):
            target = url[len("../docs/"):]
        elif url.endswith(".ipynb") and "/" not in url:
            target = f"{SITE_DIR}/{url}"
        else:
            raise PluginError(f"tutorials: {page.file.src_uri} links to {url}, which is not a docs page or a "
                              "tutorial; link ../docs/<page>.md or <notebook>.ipynb")
        file = files.get_file_from_path(target)
        if file is None:
            raise PluginError(f"tutorials: {page.file.src_uri} links to {url}, but docs/{target} does not exist")
        return f'href="{file.url_relative_to(page.file)}{anchor}"'

    return _HREF.sub(repl, html)


def on_page_content(html, page, config, files):
    if not page.file.src_uri.startswith(f"{SITE_DIR}/") or not page.file.src_uri.endswith(".ipynb"):
        return html
    for pattern in _CDN_SCRIPTS:
        html = pattern.sub("", html)
    return _banner(page, config, files) + _rewrite_links(html, page, files)
