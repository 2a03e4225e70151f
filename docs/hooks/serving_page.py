"""mkdocs hook: the serving guide is optional until it lands.

``docs/serving.md`` is written together with ``python -m optimized.serve``. Until that file exists, its nav entry
is left out and links to it are shown as plain text, so that the strict build of the rest of the site does not
depend on it; once the file exists, nothing here changes anything and every link to it is checked as usual.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.serving_page")

PAGE = "serving.md"
_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?:\.\./)*" + re.escape(PAGE) + r"(?:#[^)]*)?\)")


def _absent(config) -> bool:
    return not (Path(config["docs_dir"]) / PAGE).is_file()


def _drop(nav):
    out = []
    for item in nav:
        if isinstance(item, dict):
            (title, value), = item.items()
            if value == PAGE:
                continue
            item = {title: _drop(value) if isinstance(value, list) else value}
        elif item == PAGE:
            continue
        out.append(item)
    return out


def on_config(config):
    if _absent(config) and config["nav"]:
        log.info("%s does not exist yet: its nav entry is left out and links to it are shown as text", PAGE)
        config["nav"] = _drop(config["nav"])
    return config


def on_page_markdown(markdown, page, config, files):
    return _LINK.sub(lambda m: m["text"], markdown) if _absent(config) else markdown
