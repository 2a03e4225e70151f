"""mkdocs hook: render the project's docstrings cleanly, and keep `mkdocs build --strict` meaningful.

The docstrings are written for readers of the source first, with three habits that Markdown
does not share. This hook adapts the rendered API pages only; the docstrings stay as they are.

1. Shape comments in brackets (``h_k [.., d]``, ``W1[x_{k-1}] [.., r]``: every tensor's shape beside it).
   Python-Markdown reads ``[a] [.., r]`` as a reference-style link and mkdocs-autorefs warns that it cannot
   resolve ``.., r``, which fails the strict build. A shape holds an ellipsis (``..``, ``…``) or is a
   comma-separated list of names with no dotted Python path among them; exactly those warnings are dropped. An
   unresolved reference to a real identifier (``reference.verify.rejection_sample``) still fails the build.
2. Sphinx roles (``:class:`DrafterConfig```): Markdown shows the role name as text, ":class: DrafterConfig".
   The role is removed and the name stays as inline code.
3. reStructuredText literal-block markers ("Layout of a checkpoint directory::" before an indented block): the
   indented block already renders as code, so the doubled colon becomes a single one.
"""

from __future__ import annotations

import logging
import re

# The quoted part of autorefs' "Could not find cross-reference target '...'" warning.
_TARGET = re.compile(r"Could not find cross-reference target '([^']*)'")
_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|obj|exc|const):(?=<code>)")
_RST_LITERAL = re.compile(r"(?<=\S)::(?=</p>)")


def _is_shape(target: str) -> bool:
    """``.., r`` or ``R, γ, V``: an ellipsis, or several comma-separated names none of which is a dotted path."""
    if ".." in target or "…" in target:
        return True
    parts = [p.strip() for p in target.split(",")]
    return len(parts) > 1 and all(p and "." not in p for p in parts)


class _ShapeBracketFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        match = _TARGET.search(record.getMessage())
        return not (match and _is_shape(match.group(1)))


def on_config(config):
    # mkdocs installs its strict-mode warning counter on the "mkdocs" logger just before on_config, so a
    # handler filter here sees every plugin's warning before it is counted or printed.
    for handler in logging.getLogger("mkdocs").handlers:
        if not any(isinstance(f, _ShapeBracketFilter) for f in handler.filters):
            handler.addFilter(_ShapeBracketFilter())
    return config


def on_page_content(html, page, config, files):
    if not page.file.src_uri.startswith("api/"):
        return html
    # Only rendered prose is touched: highlighted source listings escape the backquote, so a role written in
    # the source (":class:`X`") never precedes a literal "<code>" tag and is left as it is.
    html = _SPHINX_ROLE.sub("", html)
    return _RST_LITERAL.sub(":", html)
