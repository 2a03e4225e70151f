"""mkdocs hook: the configuration reference, generated from the config classes' source at build time.

A page line ``<!-- config-reference -->`` becomes one table per configuration class: every field with its type,
its default and its reason, read from the source with ``ast`` (the modules are parsed, never imported, so the
site builds without torch). New fields appear on the page by themselves, and a renamed or moved class fails the
strict build instead of leaving a stale table.

Which classes: every dataclass and enum of ``reference/config.py`` in source order, then the engine's
``EngineConfig`` and the per-request ``SamplingParams``, looked up by name anywhere under ``optimized/``.

Where a field's reason comes from (the project writes reasons as ``#`` comments, which docstring tools drop):

* the comment at the end of the field's line, continued by the comment lines directly below it;
* a comment block directly above a field that has no comment of its own introduces that field instead.

So ``threshold: float = 0.5  # threshold mode: …`` is documented by its own line, and ``draft_gate`` by the
block written above it. A comment line ``# --- title ---`` starts a group of fields (a bold row in the table). A
field with no comment borrows the reason of a same-named field of a class shown before it (``SamplingParams``'
sampling fields are ``GenerationConfig``'s); a field with neither is shown as such and listed in the build log.
Annotations that name a ``Literal`` alias of the same module are spelled out (``HeadType`` -> its values).
"""

from __future__ import annotations

import ast
import io
import logging
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.config_reference")

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^<!-- config-reference -->$", flags=re.M)
CONFIG_MODULE = ROOT / "reference" / "config.py"
ENGINE_CLASSES = ("EngineConfig", "SamplingParams")  # searched for under optimized/
CONFIG_PAGE = "configuration.md"


@dataclass
class Entry:
    name: str
    annotation: str = ""
    default: str = ""
    reason: list[str] = field(default_factory=list)
    group: str = ""  # the "# --- title ---" heading that starts a group with this field
    literal: list[str] = field(default_factory=list)  # the values of a Literal alias annotation, if it is one


@dataclass
class ConfigClass:
    name: str
    module: str
    kind: str  # "dataclass" or "enum"
    doc: str
    entries: list[Entry]


GROUP = re.compile(r"^-{2,}\s*(.*?)\s*-{2,}$")


def _join(parts: list[str]) -> str:
    """Comment lines as one sentence; a word hyphenated across two lines ("break-" + "even") is rejoined."""
    text = ""
    for part in parts:
        text += part if (text.endswith("-") and part[:1].islower()) else (" " if text else "") + part
    return text


def _literal_aliases(tree: ast.Module) -> dict[str, list[str]]:
    """``HeadType = Literal["markov", "rnn", "none"]`` -> {"HeadType": ["'markov'", "'rnn'", "'none'"]}."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript) and ast.unparse(node.value.value) == "Literal"):
            values = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            out[node.targets[0].id] = [ast.unparse(v) for v in values]
    return out


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line number -> (comment text without '#', whether the line holds nothing but the comment)."""
    out = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = not lines[row - 1][:col].strip()
            out[row] = (tok.string.lstrip("#").strip(), alone)
    return out


def _default_text(value: ast.expr | None) -> str:
    """The default as the reader would write it: ``field(default_factory=dict)`` -> ``{}``."""
    if value is None:
        return ""
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
            if kw.arg == "default_factory":
                factory = kw.value
                if isinstance(factory, ast.Lambda):
                    return ast.unparse(factory.body)
                return {"dict": "{}", "list": "[]", "tuple": "()", "set": "set()"}.get(ast.unparse(factory),
                                                                                        f"{ast.unparse(factory)}()")
    return ast.unparse(value)


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("dataclass", "dataclasses.dataclass") for d in node.decorator_list)


def _is_enum(node: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1] in ("Enum", "IntEnum", "StrEnum") for b in node.bases)


def _entry_nodes(node: ast.ClassDef, kind: str) -> list[tuple[Entry, ast.stmt]]:
    found = []
    for stmt in node.body:
        if kind == "dataclass" and isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found.append((Entry(stmt.target.id, ast.unparse(stmt.annotation), _default_text(stmt.value)), stmt))
        elif (kind == "enum" and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
              and isinstance(stmt.targets[0], ast.Name) and not stmt.targets[0].id.startswith("_")):
            found.append((Entry(stmt.targets[0].id, "", ast.unparse(stmt.value)), stmt))
    return found


def _attach_reasons(entries: list[tuple[Entry, ast.stmt]], comments: dict[int, tuple[str, bool]],
                    class_end: int) -> None:
    """Apply the two rules of the module docstring to every field of one class."""
    for entry, stmt in entries:
        trailing = comments.get(stmt.end_lineno)
        if trailing and not trailing[1]:
            entry.reason.append(trailing[0])
    for i, (entry, stmt) in enumerate(entries):
        nxt = entries[i + 1] if i + 1 < len(entries) else None
        stop = nxt[1].lineno if nxt else class_end + 1
        block, line = [], stmt.end_lineno + 1
        while line < stop and line in comments and comments[line][1]:
            block.append(comments[line][0])
            line += 1
        if not block:
            continue
        if nxt is not None and line == nxt[1].lineno and any(GROUP.match(b) for b in block):
            nxt[0].group = next(GROUP.match(b).group(1) for b in block if GROUP.match(b))
            block = [b for b in block if not GROUP.match(b)]
        introduces_next = nxt is not None and line == nxt[1].lineno and not nxt[0].reason
        (nxt[0] if introduces_next else entry).reason.extend(block)
    # A block above the first field introduces it (or names its group).
    if entries:
        first, stmt = entries[0]
        block, line = [], stmt.lineno - 1
        while line in comments and comments[line][1]:
            block.insert(0, comments[line][0])
            line -= 1
        groups = [GROUP.match(b).group(1) for b in block if GROUP.match(b)]
        first.group = groups[0] if groups else first.group
        first.reason[:0] = [b for b in block if not GROUP.match(b)]


def read_classes(path: Path, names: tuple[str, ...] | None = None) -> list[ConfigClass]:
    """The dataclasses and enums of one file (all of them, or only ``names``), in source order."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    comments = _comments(source)
    aliases = _literal_aliases(tree)
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or (names is not None and node.name not in names):
            continue
        kind = "dataclass" if _is_dataclass(node) else "enum" if _is_enum(node) else None
        if kind is None:
            continue
        entries = _entry_nodes(node, kind)
        _attach_reasons(entries, comments, node.end_lineno)
        for entry, _ in entries:
            entry.literal = aliases.get(entry.annotation, [])
        doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
        out.append(ConfigClass(node.name, module, kind, doc, [e for e, _ in entries]))
    return out


def find_class(name: str, package: Path) -> ConfigClass:
    """A class defined anywhere under ``package`` (the engine's modules may move; the class must exist once)."""
    hits = [c for path in sorted(package.rglob("*.py")) if f"class {name}" in path.read_text(encoding="utf-8")
            for c in read_classes(path, (name,))]
    if len(hits) != 1:
        raise LookupError(f"config reference: expected one class {name} under {package}, found {len(hits)}; "
                          f"update docs/hooks/config_reference.py")
    return hits[0]


def all_classes() -> list[ConfigClass]:
    classes = read_classes(CONFIG_MODULE)
    classes += [find_class(name, ROOT / "optimized") for name in ENGINE_CLASSES]
    return classes


def _cell(text: str) -> str:
    """Table-cell safe: pipes escaped, code in backquotes kept on one line."""
    return text.replace("|", "\\|").replace("\n", " ")


def render_class(c: ConfigClass, borrowed: dict[str, str]) -> str:
    lines = [f"### `{c.name}`", "", f"`{c.module}.{c.name}`: {c.doc}", ""]
    if c.kind == "enum":
        lines += ["| member | value | meaning |", "|---|---|---|"]
        for e in c.entries:
            lines.append(f"| `{e.name}` | `{_cell(e.default)}` | {_cell(_join(e.reason)) or '—'} |")
        return "\n".join(lines) + "\n"
    lines += ["| field | type | default | why |", "|---|---|---|---|"]
    for e in c.entries:
        if e.group:
            lines.append(f"| **{_cell(e.group)}** | | | |")
        default = f"`{_cell(e.default)}`" if e.default else "*required*"
        reason = _cell(_join(e.reason)) or borrowed.get(e.name, "*(no comment in the source)*")
        # A Literal's values as separate code spans, so that a long list wraps inside the column.
        kind = " \\| ".join(f"`{_cell(v)}`" for v in e.literal) if e.literal else f"`{_cell(e.annotation)}`"
        lines.append(f"| `{e.name}` | {kind} | {default} | {reason} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    classes = all_classes()
    borrowed: dict[str, str] = {}  # field name -> "as in `Class`: reason", from the classes shown so far
    out = []
    for c in classes:
        out.append(render_class(c, borrowed))
        for e in c.entries:
            if e.reason and e.name not in borrowed:
                borrowed[e.name] = f"as in `{c.name}`: {_cell(_join(e.reason))}"
    missing = [f"{c.name}.{e.name}" for c in classes for e in c.entries if not e.reason and e.name not in borrowed]
    if missing:
        log.info("config reference: fields without a reason comment: %s", ", ".join(missing))
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if not DIRECTIVE.search(markdown):
        return markdown
    return DIRECTIVE.sub(lambda _: render(), markdown)
