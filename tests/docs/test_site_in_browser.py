"""The built docs site in a real browser: diagrams drawn, math typeset, nothing fetched from outside, no errors.

``mkdocs build --strict`` checks links and anchors but not what a reader sees. This test serves the built site
(``site/``, or ``$DSPARK_SITE_DIR``) on 127.0.0.1 and loads a few pages in headless Chromium (Debian's ``chromium``
package, driven by Playwright; Playwright's own browser download is never used), then asserts, per page:

* every Mermaid diagram became an SVG (mkdocs-material draws each into a closed shadow root; an init script opens
  those roots so that the test can look inside, which changes nothing else);
* every formula marked by pymdownx.arithmatex was typeset by KaTeX, and no KaTeX error is shown;
* every request went to 127.0.0.1 (or was a ``data:``/``blob:`` URL) and none failed or answered ≥ 400;
* the console shows no error and no page script threw;
* on the pages with wide tables, every table fits the content column of a 1280-px window.

Without a built site, Playwright or Chromium the test is skipped, unless ``DSPARK_REQUIRE_BROWSER_TEST=1`` (set by
``.ci/run``), which turns each of those into a failure.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("DSPARK_SITE_DIR", ROOT / "site"))
REQUIRED = os.environ.get("DSPARK_REQUIRE_BROWSER_TEST") == "1"

# (path, has math, has wide tables): home, method, the tutorials overview and one rendered notebook, concepts, the
# benchmarks and guides whose tables are generated, and one API page.
PAGES = [
    ("", True, False),
    ("method/", True, False),
    ("concepts/", True, False),
    ("tutorials/", True, True),
    ("tutorials/01_lossless_verification/", True, False),
    ("when-speculation-helps/", True, True),
    ("benchmarks/", True, True),
    ("configuration/", False, True),
    ("api/reference-verify/", False, False),
]
# Chromium as root in a container: no sandbox; and none of its own background traffic (updates, sync, field trials),
# which a closed network would refuse and which is not the site's.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-default-apps"]
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, { ...init, mode: "open" }); };
"""


def _missing(reason: str):
    if REQUIRED:
        pytest.fail(reason + " (DSPARK_REQUIRE_BROWSER_TEST=1)")
    pytest.skip(reason)


def _chromium() -> str:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name) if name else None
        if path:
            return path
    _missing("no chromium executable (apt-get install chromium)")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").is_file():
        _missing(f"no built site at {SITE} (run mkdocs build first)")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[docs-test]')")
    executable = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _mermaid_sources(html: str) -> int:
    return len(re.findall(r'<pre class="mermaid"', html))


@pytest.mark.parametrize(("path", "has_math", "wide_tables"), PAGES, ids=[p[0] or "home" for p in PAGES])
def test_page_renders_offline(browser, site_url, path, has_math, wide_tables):
    html_file = SITE / path / "index.html"
    assert html_file.is_file(), f"{html_file} was not built"
    expected_diagrams = _mermaid_sources(html_file.read_text(encoding="utf-8"))

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(OPEN_SHADOW_ROOTS)
    outside, failed, errors = [], [], []

    def route(r):
        url = r.request.url
        if url.startswith(site_url):
            r.continue_()
        else:
            outside.append(url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})") if r.url.startswith(site_url) else None)
    page.on("response", lambda r: failed.append(f"{r.url} (HTTP {r.status})") if r.status >= 400 else None)
    try:
        page.goto(site_url + path, wait_until="networkidle")
        # Both are drawn after the page's scripts run (Mermaid asynchronously): wait for them, up to 30 s on a busy CPU.
        try:
            page.wait_for_function(
                "n => document.querySelectorAll('div.mermaid').length === n"
                " && [...document.querySelectorAll('div.mermaid')].every(d => d.shadowRoot?.querySelector('svg'))"
                " && [...document.querySelectorAll('.arithmatex')].every(e => e.querySelector('.katex, .katex-error'))",
                arg=expected_diagrams, timeout=30_000)
        except Exception as err:  # playwright's TimeoutError: report what was (not) drawn below
            errors.append(f"diagrams or math still not drawn after 30 s: {type(err).__name__}")
        state = page.evaluate("""() => ({
            unrendered: document.querySelectorAll('pre.mermaid').length,
            math: document.querySelectorAll('.arithmatex').length,
            untypeset: [...document.querySelectorAll('.arithmatex')].filter(e => !e.querySelector('.katex')).length,
            katex: document.querySelectorAll('.katex').length,
            katexErrors: document.querySelectorAll('.katex-error').length,
            tooWide: [...document.querySelectorAll('.md-typeset__table')].filter(
                w => w.querySelector('table').scrollWidth > w.clientWidth + 1).map(
                w => w.querySelector('tr').innerText.slice(0, 80)),
        })""")
    finally:
        context.close()

    assert not outside, f"requests left 127.0.0.1: {outside}"
    assert not failed, f"failed requests: {failed}"
    assert not errors, f"browser errors: {errors}"
    assert state["unrendered"] == 0, f"{state['unrendered']} Mermaid block(s) were not drawn"
    assert state["untypeset"] == 0 and state["katexErrors"] == 0, f"math not typeset: {state}"
    if has_math:
        assert state["katex"] > 0, "this page should show typeset math and shows none"
    if wide_tables:
        assert not state["tooWide"], f"tables wider than the content column at 1280 px: {state['tooWide']}"
