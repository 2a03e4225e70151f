"""Checks on the docs site and the tutorials that need neither mkdocs nor jupyter (those run in .ci/run).

* The tutorials are committed without outputs: CI executes them, and stale outputs in git would show results
  the current code does not produce.
* Every reference module, the optimized engine and every kernel module has an API page, so a new module cannot
  go undocumented.
* The mkdocs hook drops autorefs warnings for shape comments only, never for a real unresolved identifier.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))


def test_three_tutorials_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_lossless_verification.ipynb", "02_drafter.ipynb", "03_scheduling.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path: Path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs; clear them before committing"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


def _documented_modules() -> set[str]:
    pages = (ROOT / "docs" / "api").glob("*.md")
    return {m for p in pages for m in re.findall(r"^::: ([\w.]+)\s*$", p.read_text(), flags=re.M)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_public_module_has_an_api_page():
    required = [*(ROOT / "reference").glob("[!_]*.py"), ROOT / "optimized" / "engine.py",
                *(ROOT / "optimized" / "kernels").glob("*.py")]
    wanted = {_module_name(p) for p in required}
    missing = sorted(wanted - _documented_modules())
    assert not missing, f"modules without an API page in docs/api/: {missing}"


def test_api_pages_name_existing_modules():
    """A `::: module` directive for a module that was renamed or removed would break the strict build."""
    stale = [m for m in _documented_modules() if not (ROOT / Path(*m.split("."))).with_suffix(".py").exists()
             and not (ROOT / Path(*m.split(".")) / "__init__.py").exists()]
    assert not stale, f"docs/api/ documents modules that do not exist: {stale}"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "docs" / "hooks" / "docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", [".., r", "…, V", "R, γ, V", "B, nb, γ, d"])
def test_hook_treats_shapes_as_shapes(target: str):
    assert _hook()._is_shape(target)


@pytest.mark.parametrize("target", ["reference.verify.rejection_sample", "DSparkDrafter", "a.b, c.d", ""])
def test_hook_keeps_real_references_fatal(target: str):
    assert not _hook()._is_shape(target)


def test_hook_cleans_roles_and_literal_markers_only_in_prose():
    hook = _hook()

    class _File:
        src_uri = "api/reference-checkpoint.md"

    class _Page:
        file = _File()

    html = "<p>The :class:<code>DrafterConfig</code> stored in a directory::</p><pre>x :: y</pre>"
    out = hook.on_page_content(html, _Page(), None, None)
    assert out == "<p>The <code>DrafterConfig</code> stored in a directory:</p><pre>x :: y</pre>"
