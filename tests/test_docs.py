"""Checks on the docs site and the tutorials that need neither mkdocs nor jupyter (those run in .ci/run).

* The five tutorials are committed without outputs: CI executes them, and stale outputs in git would show results
  the current code does not produce. Each opens with what the reader will learn and ends with an exercise.
* Every reference module, the optimized engine and every kernel module has an API page, so a new module cannot
  go undocumented.
* The hooks that generate pages at build time work: the configuration reference lists every field of every config
  class, and every benchmark table a page asks for renders from its committed JSON.
* No page, notebook or README cites a file the reader does not have (the team's design notes, work logs, staging
  paths on the GPU machine), and every repository path they name in backquotes exists.
* The plain claim of the "When speculation helps" page still matches the committed engine benchmark.
* The docstrings hook drops autorefs warnings for shape comments only, never for a real unresolved identifier.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
DOC_PAGES = sorted((ROOT / "docs").rglob("*.md"))


def _hook(name: str):
    """A docs hook module, loaded as mkdocs loads it (registered in sys.modules, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


# ---------------------------------------------------------------------------------------------------- tutorials


def test_five_tutorials_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_lossless_verification.ipynb", "02_drafter.ipynb", "03_scheduling.ipynb",
                     "04_real_model.ipynb", "05_optimized_engine.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path: Path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs; clear them before committing"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_what_you_learn_and_ends_with_an_exercise(path: Path):
    cells = _cells(path)
    first, last = "".join(cells[0]["source"]), "".join(cells[-1]["source"])
    assert first.startswith("# ") and "What you will learn" in first, f"{path.name}: no 'What you will learn' opening"
    assert last.startswith("## Exercise"), f"{path.name}: the last cell should be the exercise"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_links_point_at_existing_pages(path: Path):
    """Notebook links are written for Jupyter (``../docs/page.md#anchor``); the site's hook rewrites them."""
    text = "".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown")
    for url in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if url.startswith(("http://", "https://")):
            continue
        assert url.startswith("../docs/") or re.fullmatch(r"\d\d_\w+\.ipynb", url), f"{path.name}: odd link {url}"
        assert (path.parent / url).resolve().is_file(), f"{path.name} links to {url}, which does not exist"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_of_the_project_resolve(path: Path):
    """Every ``from reference|optimized|scripts.X import a, b`` in a notebook names something that exists: a renamed
    or moved function fails here, in the test stage, rather than as a traceback in a rendered tutorial."""
    import ast
    import importlib

    code = "\n".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "code")
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT_PACKAGES:
            module = importlib.import_module(node.module)
            for alias in node.names:
                is_submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                assert hasattr(module, alias.name) or is_submodule, f"{path.name}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_PACKAGES:
                    importlib.import_module(alias.name)


PROJECT_PACKAGES = ("reference", "optimized", "scripts")


def _test_instructions(text: str) -> tuple[list[str], str]:
    """The pip lines before the test command and the time promised ("about N minutes")."""
    setup, command = text.split("python -m pytest", 1)
    pips = [line.split("#")[0].strip() for line in setup.splitlines() if line.startswith("pip install")]
    minutes = re.findall(r"about (\d+) minutes", setup + command.split("\n", 1)[0])
    return pips, minutes[0] if minutes else ""


def test_readme_home_and_ci_agree_on_the_test_setup():
    """The README, the home page and .ci/run install the same things and the README and home page promise the
    same test time."""
    readme = (ROOT / "README.md").read_text().split("## Tests", 1)[1].split("\n## ", 1)[0]
    home = (ROOT / "docs" / "index.md").read_text().split("## Tests", 1)[1].split("\n## ", 1)[0]
    (readme_pips, readme_min), (home_pips, home_min) = _test_instructions(readme), _test_instructions(home)
    assert readme_pips and readme_pips == home_pips, (readme_pips, home_pips)
    assert readme_min and readme_min == home_min, (readme_min, home_min)
    ci = (ROOT / ".ci" / "run").read_text()
    ci_extras = re.search(r'pip install -e "\.\[([\w,-]+)\]"', ci).group(1)
    assert f'-e ".[{ci_extras}]"' in readme_pips[0], "the README's test install names other extras than .ci/run"
    for package in re.findall(r"--no-deps ([^\n]+)", "\n".join(readme_pips)):
        for name in package.split():
            assert name in ci, f"{name} is installed by the README's test instructions but not by .ci/run"


# ---------------------------------------------------------------------------------------------------- API pages


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


# ---------------------------------------------------------------------------------------------------- generated pages


def test_configuration_reference_lists_every_field():
    from optimized.engine import EngineConfig, SamplingParams
    from reference import config

    hook = _hook("config_reference")
    page = hook.render()
    classes = [c for c in vars(config).values() if dataclasses.is_dataclass(c) and c.__module__ == config.__name__]
    classes += [EngineConfig, SamplingParams]
    assert {"DrafterConfig", "SchedulerConfig", "GenerationConfig"} <= {c.__name__ for c in classes}
    for cls in classes:
        section = page.split(f"### `{cls.__name__}`", 1)
        assert len(section) == 2, f"no table for {cls.__name__}"
        table = section[1].split("\n### ", 1)[0]
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in table, f"{cls.__name__}.{f.name} is missing from the configuration reference"


def test_configuration_reference_reads_comments_by_the_documented_rules(tmp_path):
    source = '''
from dataclasses import dataclass, field

@dataclass
class Demo:
    """A demo config."""

    # --- a group ---
    a: int = 1  # the reason of a
    # which continues here
    c: str = "x"  # c's own reason
    # a lead-in block for b, which has no comment of its own
    b: dict[int, int] = field(default_factory=lambda: {1: 2})
    d: float = 0.5
'''
    path = tmp_path / "demo.py"
    path.write_text(source)
    hook = _hook("config_reference")
    hook.ROOT = tmp_path
    (demo,) = hook.read_classes(path)
    a, c, b, d = demo.entries
    assert a.group == "a group" and a.reason == ["the reason of a", "which continues here"]
    assert c.reason == ["c's own reason"] and c.default == "'x'"
    assert b.reason == ["a lead-in block for b, which has no comment of its own"] and b.default == "{1: 2}"
    assert d.reason == [] and d.default == "0.5"


def _benchmark_directives():
    hook = _hook("benchmark_tables")
    for page in DOC_PAGES:
        for m in hook.DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            yield pytest.param(page, m["kind"], m["args"], id=f"{page.relative_to(ROOT / 'docs')}:{m['kind']}")


@pytest.mark.parametrize(("page", "kind", "args"), list(_benchmark_directives()))
def test_benchmark_tables_render_from_the_committed_json(page: Path, kind: str, args: str):
    import shlex

    hook = _hook("benchmark_tables")
    out = hook.render(kind, shlex.split(args), page.parent)
    assert out.strip(), f"{kind} rendered nothing"
    assert "/tmp/" not in out and "/root/" not in out, f"{kind} shows a staging path: {out[:300]}"


def test_indented_benchmark_directive_stays_inside_its_block():
    """A directive inside an admonition renders with the admonition's indent (else the table falls out of it)."""
    from types import SimpleNamespace

    hook = _hook("benchmark_tables")
    page = SimpleNamespace(file=SimpleNamespace(abs_src_path=str(ROOT / "docs" / "serving.md")))
    md = '!!! note "Start-up"\n    Text.\n\n    <!-- benchmark: startup benchmarks/serving-h200.json -->\n\nAfter.\n'
    out = hook.on_page_markdown(md, page, None, None)
    table = [line for line in out.splitlines() if "|" in line]
    assert len(table) >= 3 and all(line.startswith("    |") for line in table), out
    assert out.endswith("\nAfter.\n") and "<!--" not in out


def test_acceptance_table_shows_the_standard_error_where_recorded(tmp_path):
    import json

    hook = _hook("benchmark_tables")
    run = {"mean_accepted_length": 3.3, "per_domain": {"chat": 3.5}, "per_position_acceptance": [0.7],
           "per_position_counts": [100], "counts": {"steps": 100}, "hardware": "1x NVIDIA H200"}
    (tmp_path / "acc.json").write_text(json.dumps({"runs": {
        "new": {"T=0": {**run, "mean_accepted_length_se": 0.0412}}, "old": {"T=0": run}}}))
    rows = [line for line in hook.render("acceptance", ["acc.json"], tmp_path).splitlines() if line.startswith("| ")]
    assert "**3.300** ± 0.041" in rows[1] and "±" not in rows[2]


def test_cost_check_prices_each_measured_step_with_the_runs_own_table():
    """The cost-check table: one row per measured engine configuration, priced by the run's cost table exactly as
    the scheduler prices a step (verify time of the step's tokens and requests, plus the drafter where it drafted)."""
    from reference.cost_model import CostTable

    hook = _hook("benchmark_tables")
    bench = ROOT / "docs" / "benchmarks"
    data = json.loads((bench / "engine-serving-prompts-h200.json").read_text())
    table = CostTable.from_dict(data["cost_table"])
    rows = [line for line in hook.render("cost-check", ["engine-serving-prompts-h200.json"], bench).splitlines()
            if line.startswith("| `")]
    measured = [r for r in data["results"] if r["engine"] == "optimized"]
    assert len(rows) == len(measured)
    for line, r in zip(rows, measured):
        n = r["batch_size"]
        if r["mode"] == "none":
            price = table.verify_time(n, n)
        else:
            tokens = round(n * (1 + r["mean_verify_length"]))
            price = table.verify_time(tokens, n) + r["draft_step_fraction"] * table.draft_time(n)
        assert line.endswith(f"| {r['step_ms']:.2f} | {1e3 * price:.2f} | {r['step_ms'] / (1e3 * price):.2f} |"), line
    with pytest.raises(ValueError, match="no cost table"):
        hook.render("cost-check", ["acceptance.json"], bench)


def test_serving_table_compares_adaptive_with_the_best_other_mode():
    import json

    hook = _hook("benchmark_tables")
    bench = ROOT / "docs" / "benchmarks"
    data = json.loads((bench / "serving-h200.json").read_text())
    out = hook.render("serving", ["serving-h200.json"], bench)
    for c in sorted({r["concurrency"] for r in data["results"]}):
        here = {r["label"]: r["output_tokens_per_s"] for r in data["results"] if r["concurrency"] == c}
        ratio = here["adaptive"] / max(v for k, v in here.items() if k != "adaptive")
        row = next(line for line in out.splitlines() if line.startswith(f"| {c} |"))
        assert row.endswith(f"| {ratio:.2f}× |"), row


def test_speculation_claim_matches_the_committed_benchmark():
    """when-speculation-helps.md says plainly where speculation pays on the H200 with the shipped drafter: under a
    server's load (requests arriving) it is ahead at every batch size, in closed batches up to 16 but not from 64 up.
    If a new engine benchmark says otherwise, this fails: update the page's warning."""
    hook = _hook("benchmark_tables")
    closed = json.loads((ROOT / "docs" / "benchmarks" / "engine-h200.json").read_text())
    steady = json.loads((ROOT / "docs" / "benchmarks" / "engine-h200-steady.json").read_text())
    page = (ROOT / "docs" / "when-speculation-helps.md").read_text()
    assert "under load speculation is ahead at every batch size, in closed batches up to 16" in page
    assert "benchmarks/engine-h200.json" in page and "benchmarks/engine-h200-steady.json" in page
    for row in hook.frontier(closed):
        if row["batch"] <= 16:
            assert row["ratio"] > 1 + hook.SPREAD, f"closed batch {row['batch']}: speculation no longer pays: {row}"
        else:
            assert row["ratio"] < 1, f"closed batch {row['batch']}: speculation now wins: {row}"
    for row in hook.frontier(steady):
        assert row["ratio"] > 1, f"under load at batch {row['batch']} speculation no longer pays: {row}"


# ---------------------------------------------------------------------------------------------------- references

# What a reader of the repository does not have (checked in code too): a Markdown file that is not in the
# repository (notes kept beside it), references to a tracker's tickets by number, and the team's shorthand for its
# own conventions ...
MARKDOWN_NAME = re.compile(r"[\w-]+\.md\b")
INTERNAL_NOTES = [r"(?i)\b(?:issue|ticket)s?\s+#?\d", r"(?i)\bhouse (?:rule|style)"]
# ... and, in the docs, paths outside the repository, the GPU machine's staging paths and the raw run logs that were
# removed.
FORBIDDEN = [*INTERNAL_NOTES, r"/tmp/", r"benchmarks/runs", r"runs/h200", r"\bshared/", r"the issue's"]
SOURCES = [*DOC_PAGES, *NOTEBOOKS, ROOT / "README.md", ROOT / "mkdocs.yml"]


@functools.cache
def _repository_markdown() -> frozenset[str]:
    """The names of the Markdown files the repository holds (hidden folders and build outputs left out)."""
    names = set()
    for _, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("site", "build", "node_modules")]
        names.update(f for f in filenames if f.endswith(".md"))
    return frozenset(names)


def _foreign_markdown(text: str, known: set[str]) -> list[str]:
    """Markdown file names cited in ``text`` that no file of the repository has (case matters)."""
    return sorted({name for name in MARKDOWN_NAME.findall(text) if name not in known})


def test_foreign_markdown_names_are_found():
    known = {"method.md", "architecture.md"}
    assert _foreign_markdown("see docs/method.md and `architecture.md`", known) == []
    assert _foreign_markdown("as NOTES.md and notes/PLAN.md say", known) == ["NOTES.md", "PLAN.md"]
    assert _foreign_markdown("Method.md", known) == ["Method.md"]  # case matters: another file than method.md


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_only_what_the_reader_has(path: Path):
    text = path.read_text(encoding="utf-8")
    for pattern in FORBIDDEN:
        hits = [m.group(0) for m in re.finditer(pattern, text)]
        assert not hits, f"{path.relative_to(ROOT)} mentions {hits[0]!r}, which a reader of the repository lacks"
    foreign = _foreign_markdown(text, _repository_markdown())
    assert not foreign, f"{path.relative_to(ROOT)} cites {foreign}, which the repository does not have"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_in_docs_exist(path: Path):
    """Every `reference/…`, `optimized/…`, `scripts/…`, `tests/…`, `tutorials/…`, `checkpoints/…`, `docs/…` path in
    backquotes names a file or directory of the repository (a test id after :: must name a test in that file)."""
    text = path.read_text(encoding="utf-8")
    prefixes = ("reference/", "optimized/", "scripts/", "tests/", "tutorials/", "checkpoints/", "docs/", ".ci/")
    for span in re.findall(r"`([^`\s]+)`", text):
        if not span.startswith(prefixes) or "*" in span or "<" in span or "NAME" in span:
            continue
        file, _, test = span.partition("::")
        target = ROOT / file.rstrip("/,.;:")
        assert target.exists(), f"{path.relative_to(ROOT)} names {span}, which does not exist"
        if test:
            assert re.search(rf"def {re.escape(test)}\b", target.read_text()), f"{span}: no such test"


def test_api_pages_cite_no_new_internal_notes():
    """Docstrings and comments of reference/ and optimized/ are shown on the API pages (docstrings and source
    listings), so they cite nothing a reader lacks either."""
    found = set()
    known = _repository_markdown()
    for path in [*(ROOT / "reference").rglob("*.py"), *(ROOT / "optimized").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        for pattern in INTERNAL_NOTES:
            if re.search(pattern, text):
                found.add((str(path.relative_to(ROOT)), pattern.replace("\\", "")))
        found.update((str(path.relative_to(ROOT)), name) for name in _foreign_markdown(text, known))
    new = sorted(found)
    assert not new, f"API pages would cite notes a reader does not have: {new}"


# ---------------------------------------------------------------------------------------------------- hooks


def _fake_mermaid(tmp_path: Path) -> tuple[str, str]:
    """A local stand-in for the npm tarball: (file:// URL, its sha512 integrity string)."""
    import base64
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("package/dist/mermaid.min.js", b"window.mermaid={};"), ("package/LICENSE", b"MIT")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    path = tmp_path / "mermaid.tgz"
    path.write_bytes(buf.getvalue())
    return path.as_uri(), "sha512-" + base64.b64encode(hashlib.sha512(buf.getvalue()).digest()).decode()


def test_vendor_hook_fetches_mermaid_once_and_checks_its_hash(tmp_path):
    hook = _hook("vendor")
    url, integrity = _fake_mermaid(tmp_path)
    vendor = tmp_path / "vendor"
    assert hook.ensure_mermaid(vendor, url=url, integrity=integrity, version="1.0")
    assert (vendor / "mermaid" / "mermaid.min.js").read_bytes() == b"window.mermaid={};"
    assert (vendor / "mermaid" / "LICENSE").is_file()
    assert not hook.ensure_mermaid(vendor, url="file:///nonexistent", integrity=integrity, version="1.0")  # kept
    with pytest.raises(Exception, match="integrity"):  # another release, and a tarball that is not the pinned one
        hook.ensure_mermaid(vendor, url=url, integrity="sha512-AAAA", version="2.0")
    with pytest.raises(Exception, match="build once with network access"):
        hook.ensure_mermaid(tmp_path / "empty", url=(tmp_path / "missing.tgz").as_uri(), integrity=integrity)


def test_vendor_hook_pins_the_registry_tarball():
    hook = _hook("vendor")
    assert hook.MERMAID_URL == f"https://registry.npmjs.org/mermaid/-/mermaid-{hook.MERMAID_VERSION}.tgz"
    assert hook.MERMAID_INTEGRITY.startswith("sha512-")
    assert "docs/assets/vendor/mermaid/" in (ROOT / ".gitignore").read_text()  # fetched, never committed


@pytest.mark.parametrize("target", [".., r", "…, V", "R, γ, V", "B, nb, γ, d"])
def test_hook_treats_shapes_as_shapes(target: str):
    assert _hook("docstrings")._is_shape(target)


@pytest.mark.parametrize("target", ["reference.verify.rejection_sample", "DSparkDrafter", "a.b, c.d", ""])
def test_hook_keeps_real_references_fatal(target: str):
    assert not _hook("docstrings")._is_shape(target)


def test_hook_cleans_roles_and_literal_markers_only_in_prose():
    hook = _hook("docstrings")

    class _File:
        src_uri = "api/reference-checkpoint.md"

    class _Page:
        file = _File()

    html = "<p>The :class:<code>DrafterConfig</code> stored in a directory::</p><pre>x :: y</pre>"
    out = hook.on_page_content(html, _Page(), None, None)
    assert out == "<p>The <code>DrafterConfig</code> stored in a directory:</p><pre>x :: y</pre>"
