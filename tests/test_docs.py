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


def _hook_comments(pattern: str, name: str):
    """Every ``<!-- ... -->`` of the benchmark hook's ``pattern`` (DIRECTIVE: tables, INLINE: values) on every page,
    as (page, its ``name`` group, its arguments)."""
    regex = getattr(_hook("benchmark_tables"), pattern)
    for page in DOC_PAGES:
        for m in regex.finditer(page.read_text(encoding="utf-8")):
            yield pytest.param(page, m[name], m["args"], id=f"{page.relative_to(ROOT / 'docs')}:{m[name]}")


@pytest.mark.parametrize(("page", "kind", "args"), list(_hook_comments("DIRECTIVE", "kind")))
def test_benchmark_tables_render_from_the_committed_json(page: Path, kind: str, args: str):
    import shlex

    hook = _hook("benchmark_tables")
    out = hook.render(kind, shlex.split(args), page.parent)
    assert out.strip(), f"{kind} rendered nothing"
    assert "/tmp/" not in out and "/root/" not in out, f"{kind} shows a staging path: {out[:300]}"
    words = WORKSHOP_WORDS.findall(out)  # a file's notes reach the page too: they label results by what ran
    assert not words, f"{kind} renders {words[:3]} from {args.split()[0]}: label results by hardware and command"


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
    """when-speculation-helps.md says plainly where speculation pays on the H200 with the shipped drafter: ahead in
    closed batches up to 16, level (within the run-to-run spread) or behind from 64 up, and under a server's load
    (requests arriving) ahead or level at every batch size, ahead at some. If a new engine benchmark says otherwise,
    this fails: update the page's warning."""
    hook = _hook("benchmark_tables")
    closed = json.loads((ROOT / "docs" / "benchmarks" / "engine-h200.json").read_text())
    steady = json.loads((ROOT / "docs" / "benchmarks" / "engine-h200-steady.json").read_text())
    page = (ROOT / "docs" / "when-speculation-helps.md").read_text()
    assert "speculation is ahead in closed batches up to 16, level or behind beyond, ahead or level under load" in page
    assert "benchmarks/engine-h200.json" in page and "benchmarks/engine-h200-steady.json" in page
    for row in hook.frontier(closed):
        if row["batch"] <= 16:
            assert row["ratio"] > 1 + hook.SPREAD, f"closed batch {row['batch']}: speculation no longer pays: {row}"
        else:
            assert row["ratio"] < 1 + hook.SPREAD, f"closed batch {row['batch']}: speculation now pays: {row}"
    for row in hook.frontier(steady):
        assert row["ratio"] > 1 - hook.SPREAD, f"under load at batch {row['batch']} plain decoding is faster: {row}"
    assert any(row["verdict"] == "speculation helps" for row in hook.frontier(steady)), "under load: no batch helps"


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


# ---------------------------------------------------------------------------------------------------- numbers

BENCH = ROOT / "docs" / "benchmarks"
HAND_WRITTEN = [*sorted((ROOT / "docs").glob("*.md")), BENCH / "index.md", ROOT / "README.md"]


def _prose(text: str) -> str:
    """A page's own words: without HTML comments (the hooks' directives, rendered from JSON) and fenced code."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"^[ ]*```.*?^[ ]*```", "", text, flags=re.S | re.M)


def _markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize(("page", "name", "args"), list(_hook_comments("INLINE", "name")))
def test_inline_values_render_from_the_committed_json(page: Path, name: str, args: str):
    import shlex

    out = _hook("benchmark_tables").value(name, shlex.split(args), page.parent)
    assert out and "\n" not in out and re.search(r"\d", out), f"{name} {args} rendered {out!r}"


def test_inline_values_render_ranges_and_verdicts():
    hook = _hook("benchmark_tables")
    engine = json.loads((BENCH / "engine-h200.json").read_text())
    rows = hook.frontier(engine)
    helps = [r for r in rows if r["verdict"] == "speculation helps"]
    lo, hi = min(r["ratio"] for r in helps), max(r["ratio"] for r in helps)
    want = f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"
    assert hook.value("engine-range", ["engine-h200.json", "verdict=helps"], BENCH) == want
    assert hook.value("engine-batches", ["engine-h200.json", "verdict=helps"], BENCH).replace(" and ", ", ") == \
        ", ".join(str(r["batch"]) for r in helps)
    acc = json.loads((BENCH / "acceptance.json").read_text())
    shipped = next(iter(acc["runs"].values()))
    assert hook.value("tau", ["acceptance.json", "T=1"], BENCH) == f"{shipped['T=1']['mean_accepted_length']:.2f}"
    assert hook.value("tau", ["acceptance.json", "domain=code"], BENCH) == f"{shipped['T=0']['per_domain']['code']:.2f}"


def test_acceptance_labels_name_the_drafter_not_how_it_was_trained():
    hook = _hook("benchmark_tables")
    assert hook._arm_label("dspark, 5 layers, int8 (dense trainer, step 40,000 of 40,000: nine loans, deepened)") == \
        "dspark, 5 layers, int8"
    assert hook._arm_label("5 layers, int8, step 34,274 (eight loans), re-measured") == \
        "5 layers, int8, step 34,274, re-measured"
    assert hook._arm_label("step 23,670 with its bfloat16 weights, measured in its training loan (loan 5)") == \
        "step 23,670 with its bfloat16 weights"


# Words about how the measurements were organised, not about what ran: a result is labelled by its hardware,
# command and drafter checkpoint.
WORKSHOP_WORDS = re.compile(r"(?i)\bloans?\b|\b(?:work|GPU|training) sessions?\b")


@pytest.mark.parametrize("path", [*HAND_WRITTEN, *NOTEBOOKS], ids=lambda p: str(p.relative_to(ROOT)))
def test_results_are_labelled_by_what_ran(path: Path):
    hits = WORKSHOP_WORDS.findall(_markdown_of(path))
    assert not hits, f"{path.relative_to(ROOT)} says {hits[:3]}: label a result by hardware, command and checkpoint"


# A page a user reads in minutes: none over 4,000 words, the hand-written site under 35,000 (generated pages, the
# API reference and the configuration tables, are not counted).
PAGE_WORDS, TOTAL_WORDS = 4_000, 35_000


def test_pages_stay_within_their_word_budget():
    counts = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").split()) for p in HAND_WRITTEN}
    long = {p: n for p, n in counts.items() if n > PAGE_WORDS}
    assert not long, f"pages over {PAGE_WORDS:,} words: {long}"
    assert sum(counts.values()) <= TOTAL_WORDS, f"{sum(counts.values()):,} words in all (budget {TOTAL_WORDS:,})"


# The measurements a speed-up is a ratio of (throughputs and times), what a comparison holds fixed, and the fields
# that name the alternatives it compares.
SPEED_KEY = re.compile(r"^(?:tokens_per_s|output_tokens_per_s|slot_predictions_per_s|step_ms|median_step_s|us"
                       r"|\w+_us_per_layer)$")
GROUP_KEYS = ("batch_size", "concurrency", "R", "rows", "tokens_per_step")
ALTERNATIVES = ("label", "mode", "backend", "step", "arm", "engine", "name", "variant", "streaming")


@functools.cache
def _ratio_candidates(files: tuple[str, ...] | None = None) -> list[float]:
    """Every ratio the current benchmark files support: two measurements of one kind in one file at the same batch
    size, concurrency or row count (tokens/s of two policies, step times, slot predictions per second, ...), and
    every ratio a file records itself (keys with over, ratio, speedup, efficiency)."""
    out: list[float] = []

    def pairs(values: list[float]) -> None:
        out.extend(a / b for a in values for b in values if a > 0 and b > 0 and a != b)

    def walk(node, key: str = "") -> None:
        if isinstance(node, dict):
            nums = [v for v in node.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if key == "tokens_per_s":
                pairs(nums)
            for k, v in node.items():
                if isinstance(v, (int, float)) and re.search(r"over|ratio|speedup|efficiency", k):
                    out.append(float(v))
                walk(v, k)
        elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            groups: dict[tuple, list[dict]] = {}
            for x in node:  # the same op, case, batch size ...: only the compared alternative differs
                same = tuple(sorted((k, v) for k, v in x.items() if k in GROUP_KEYS or
                                    (isinstance(v, str) and k not in ALTERNATIVES)))
                groups.setdefault(same, []).append(x)
            for items in groups.values():
                if len(items) > 16:  # a parameter sweep, not a comparison
                    continue
                for k in {k for x in items for k in x if SPEED_KEY.search(k)}:
                    pairs([x[k] for x in items if isinstance(x.get(k), (int, float)) and not isinstance(x[k], bool)])
            for x in node:
                walk(x, key)
        elif isinstance(node, list):
            for x in node:
                walk(x, key)

    for path in sorted(BENCH.glob("*.json")):
        if files is None or path.name in files:
            walk(json.loads(path.read_text()))
    return out


def _cited_benchmarks(text: str) -> tuple[str, ...] | None:
    """The benchmark files a page names (in directives, links or backquotes); None if it names none."""
    names = {n for n in re.findall(r"([\w.-]+\.json)\b", text) if (BENCH / n).is_file()}
    return tuple(sorted(names)) or None


# Ratios a page may state that no benchmark file holds, each with its reason.
RATIOS_NOT_MEASURED_HERE = {
    ("docs/architecture.md", "1.25"): "the spacing of the engine's CUDA-graph token buckets, a design constant",
    ("docs/benchmarks/index.md", "1.16"): "the paper's own gain from its sequential head, quoted for comparison",
    ("docs/benchmarks/index.md", "1.18"): "the paper's own gain from its sequential head, quoted for comparison",
}
RATIO = re.compile(r"(?<![\w.,])(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?\s?×")


def _stated_ratios(text: str) -> list[str]:
    return [r for m in RATIO.finditer(_prose(text)) for r in m.groups() if r]


def test_ratio_support_is_specific():
    """What supports a ratio is narrow enough to catch a wrong one: the engine benchmark alone leaves most
    two-digit ratios between 1 and 2 unsupported, and a ratio it does hold is found."""
    engine = _ratio_candidates(("engine-h200.json",))
    covered = {round(c, 2) for c in engine if 1.0 <= c <= 2.0}
    assert len(covered) < 60, f"{len(covered)} of 101 ratios in [1, 2] would pass"
    best = max(r["ratio"] for r in _hook("benchmark_tables").frontier(json.loads((BENCH / "engine-h200.json")
                                                                                    .read_text())))
    assert any(abs(c - round(best, 2)) <= 0.005 for c in engine)


def test_stated_ratios_are_found():
    assert _stated_ratios("1.17× at batch 1, 0.74–0.83× of it, 3.1× faster; `2×` in code") == \
        ["1.17", "0.74", "0.83", "3.1", "2"]
    assert _stated_ratios("<!-- value: engine x.json --> and\n```\n1.5×\n```\n") == []


@pytest.mark.parametrize("path", [*HAND_WRITTEN, *NOTEBOOKS], ids=lambda p: str(p.relative_to(ROOT)))
def test_stated_speedups_are_supported_by_a_current_benchmark(path: Path):
    """A speed-up a page types by hand (`1.23×`) must be a ratio that a benchmark file the page cites supports
    (any current file, if it cites none), within the rounding of its digits. Where a number can change with the next
    run, render it instead (``<!-- value: … -->``, docs/hooks/benchmark_tables.py)."""
    name = path.relative_to(ROOT).as_posix()
    text = _markdown_of(path)
    candidates = _ratio_candidates(_cited_benchmarks(text))  # the files the page cites, else every file
    unsupported = []
    for r in _stated_ratios(text):
        if (name, r) in RATIOS_NOT_MEASURED_HERE:
            continue
        half = 0.5 * 10 ** -len(r.partition(".")[2]) + 1e-9
        if not any(abs(c - float(r)) <= half for c in candidates):
            unsupported.append(f"{r}×")
    assert not unsupported, f"{name} states {unsupported}, which no file in docs/benchmarks/ supports"


def _shipped() -> dict:
    acc = json.loads((BENCH / "acceptance.json").read_text())
    shipped = next(iter(acc["runs"].values()))
    summary = json.loads((ROOT / "checkpoints" / "smollm2-135m-instruct-dspark" / "summary.json").read_text())
    int8 = json.loads((BENCH / "int8-check-cpu.json").read_text())["weight_bytes"]
    return {"tau0": shipped["T=0"]["mean_accepted_length"], "tau1": shipped["T=1"]["mean_accepted_length"],
            "minutes": summary["wall_s"] / 60, "steps": summary["steps_planned"], "int8_mb": int8["int8"] / 1e6,
            "bf16_mb": int8["original"] / 1e6}


# Named quantities that pages type by hand: where any page states one, it must be the committed file's value (so
# two pages can never disagree). Each pattern's group is the number; the key names its value in _shipped().
NAMED_QUANTITIES = [
    ("the shipped drafter's greedy τ", r"τ\s*(?:=|≈)\s*(\d\.\d+)\s+greedy", "tau0"),
    ("the shipped drafter's τ at T = 1", r"τ\s*(?:=|≈)\s*\d\.\d+\s+greedy\s+and\s+(\d\.\d+)\s+at\s+T\s*=\s*1", "tau1"),
    ("the shipped drafter's training time", r"(\d+) minutes(?: of training)? on one H200", "minutes"),
    ("the shipped drafter's schedule", r"(\d{1,3}(?:,\d{3})+)-step schedule", "steps"),
    ("the int8 drafter's size", r"int8[^.]{0,40}?\((\d+\.\d) MB", "int8_mb"),
    ("the bfloat16 drafter's size", r"against (\d+\.\d) MB in bfloat16", "bf16_mb"),
]


@pytest.mark.parametrize(("what", "pattern", "key"), NAMED_QUANTITIES, ids=[q[0] for q in NAMED_QUANTITIES])
def test_named_quantities_agree_with_the_committed_files(what: str, pattern: str, key: str):
    want = _shipped()[key]
    found = []
    for path in [*HAND_WRITTEN, *NOTEBOOKS]:
        text = re.sub(r"\s+", " ", re.sub(r"(?m)^[ ]*>[ ]?", "", _prose(_markdown_of(path))))  # one line, no quotes
        for m in re.finditer(pattern, text):
            stated = m.group(1)
            digits = len(stated.partition(".")[2])
            value = float(stated.replace(",", ""))
            found.append(path.name)
            assert abs(value - want) <= 0.5 * 10 ** -digits + 1e-9, \
                f"{path.relative_to(ROOT)} states {what} as {stated}; the committed files say {want:.4g}"
    assert found, f"no page states {what} any more: drop its entry from NAMED_QUANTITIES"


def test_eval_acceptance_limit_reports_every_domain():
    """The training guide says ``--limit N`` on the domain-sorted evaluation file still reports every domain."""
    from scripts.eval_acceptance import spread_over_domains

    rows = [(d, [i]) for i, d in enumerate(["chat"] * 4 + ["code"] * 4 + ["math"] * 4)]
    picked = spread_over_domains(rows, 6)
    assert [d for d, _ in picked] == ["chat", "chat", "code", "code", "math", "math"]
    assert [ids[0] for _, ids in picked] == [0, 1, 4, 5, 8, 9]  # file order within a domain
    assert spread_over_domains(rows, None) == rows and spread_over_domains(rows, 99) == rows
    assert [d for d, _ in spread_over_domains(rows, 4)] == ["chat", "chat", "code", "math"]
