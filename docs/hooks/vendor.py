"""MkDocs hook: make sure the site's copy of Mermaid exists before the build, fetching it once if it does not.

Mermaid (which draws the ```mermaid diagrams) is 3.6 MB, too large to keep in the repository, whose whole tree
travels with every run on a lent GPU machine. So ``docs/assets/vendor/mermaid/`` is not committed: the first build
downloads the pinned release from the npm registry, checks it against the registry's sha512 integrity hash pinned
below, and keeps ``dist/mermaid.min.js`` and the licence there (git ignores them). Every later build, and every
reader of the built site, works offline. KaTeX is small and stays committed next to it.

To move to another Mermaid release, change ``MERMAID_VERSION`` and ``MERMAID_INTEGRITY`` (the ``dist.integrity``
field of ``https://registry.npmjs.org/mermaid/<version>``), delete ``docs/assets/vendor/mermaid/``, build, and run
the browser test (``tests/docs/test_site_in_browser.py``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import tarfile
import urllib.request
from pathlib import Path

try:
    from mkdocs.exceptions import PluginError
except ImportError:  # the unit tests (tests/test_docs.py) load this hook where mkdocs is not installed
    PluginError = RuntimeError

log = logging.getLogger("mkdocs.hooks.vendor")

MERMAID_VERSION = "11.17.2"
MERMAID_INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MERMAID_URL = f"https://registry.npmjs.org/mermaid/-/mermaid-{MERMAID_VERSION}.tgz"
# tarball member -> file under docs/assets/vendor/mermaid/
MERMAID_FILES = {"package/dist/mermaid.min.js": "mermaid.min.js", "package/LICENSE": "LICENSE"}
STAMP = "VERSION"  # records which release the folder holds


def ensure_mermaid(vendor_dir: Path, *, url: str = MERMAID_URL, integrity: str = MERMAID_INTEGRITY,
                   version: str = MERMAID_VERSION, timeout_s: float = 120.0) -> bool:
    """Fetch Mermaid into ``vendor_dir/mermaid`` unless that release is already there; True if it downloaded."""
    target = vendor_dir / "mermaid"
    stamp = target / STAMP
    if stamp.is_file() and stamp.read_text().strip() == version and \
            all((target / name).is_file() for name in MERMAID_FILES.values()):
        return False
    log.info("fetching Mermaid %s from %s (once; kept in %s)", version, url, target)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            blob = response.read()
    except OSError as err:
        raise PluginError(f"the docs need Mermaid {version} in {target}, which is not there yet, and downloading it "
                          f"from {url} failed ({err}); build once with network access, or place the package's "
                          f"dist/mermaid.min.js and LICENSE there and write '{version}' into {stamp}") from err
    algorithm, _, expected = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, blob).digest()).decode()
    if got != expected:
        raise PluginError(f"{url} does not match its pinned {algorithm} integrity hash (got {got}); refusing to use it")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member, name in MERMAID_FILES.items():
            data = tar.extractfile(member)
            if data is None:
                raise PluginError(f"{url} has no file {member}")
            (target / name).write_bytes(data.read())
    stamp.write_text(version + "\n")
    return True


def on_config(config, **kwargs):
    ensure_mermaid(Path(config["docs_dir"]) / "assets" / "vendor")
    return config
