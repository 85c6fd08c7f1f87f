"""Mechanical checks of pallas_kernels/ read from the source with `ast` (no jax, well under a second).

- No file takes a private (underscore) name from another: not `from pallas_kernels.x import _y`,
  `from .x import _y`, `import pallas_kernels._x`, nor `x._y` on an imported kernel module. Helpers
  that a family shares live in a named module under public names.
- No import inside a function body: an import there hides a circle between files, or a dependency.
- Module docstrings say what, layout, limits and link the benchmark page: at most MAX_DOC_LINES lines,
  no dates (measurements live in docs/benchmarks.md), and no file speaks of work sessions or issues.
"""
import ast
import functools
import re
from pathlib import Path

import pytest

PKG = "pallas_kernels"
ROOT = Path(__file__).resolve().parents[2] / PKG
FILES = sorted(ROOT.glob("*.py"))
MAX_DOC_LINES = 20
DATE = re.compile(r"\b20\d\d-[01]\d")
WORK_LOG = re.compile(r"\b(session|issue)s? #?\d+", re.IGNORECASE)


@functools.cache
def _tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kernel_module(node: ast.ImportFrom) -> str | None:
    """The pallas_kernels module an ImportFrom reads from ('' for the package itself), else None."""
    if node.level:                       # relative: inside the package
        return node.module or ""
    if node.module == PKG:
        return ""
    if node.module and node.module.startswith(PKG + "."):
        return node.module[len(PKG) + 1:]
    return None


def private_imports(tree) -> list[str]:
    """Every private name one file takes from another kernel file, as 'line: what'."""
    found, module_aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (mod := _kernel_module(node)) is not None:
            if any(_is_private(part) for part in mod.split(".") if part):
                found.append(f"{node.lineno}: from {PKG}.{mod} (a private module)")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: from {PKG}.{mod or ''} import {alias.name}".replace(". import", " import"))
                elif mod == "":               # `from pallas_kernels import x`: x is a module
                    module_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PKG:
                    if any(_is_private(p) for p in parts[1:]):
                        found.append(f"{node.lineno}: import {alias.name}")
                    if alias.asname:
                        module_aliases.add(alias.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def imports_in_functions(tree) -> list[str]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append(f"{node.lineno}: in {getattr(fn, 'name', 'lambda')}")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_private_name_crosses_files(path):
    assert not private_imports(_tree(path)), f"{path.name} takes private names from other files: " \
        f"{private_imports(_tree(path))}; move the helper into a shared module under a public name"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_import_inside_a_function(path):
    found = imports_in_functions(_tree(path))
    assert not found, f"{path.name} imports inside functions at {found}; import at the top of the file"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_module_docstring_is_short_and_undated(path):
    text = path.read_text()
    if not text.strip():
        return   # an empty __init__.py
    doc = ast.get_docstring(_tree(path))
    assert doc, f"{path.name} has no module docstring (what, layout, limits, link)"
    n = len(doc.splitlines())
    assert n <= MAX_DOC_LINES, f"{path.name}: module docstring of {n} lines (at most {MAX_DOC_LINES}); " \
        "move measurements to docs/benchmarks.md and link its anchor"
    assert not DATE.search(doc), f"{path.name}: a date in the module docstring ({DATE.search(doc).group()}): " \
        "dated measurements belong in docs/benchmarks.md"
    assert not WORK_LOG.search(text), f"{path.name}: {WORK_LOG.search(text).group()!r}: code speaks of the code"


def test_the_checks_catch_what_they_forbid():
    """Each check fails on a small source that breaks its rule (so a green run means something)."""
    bad = ast.parse("from pallas_kernels.flash_attention import _dot\nfrom .x import _y\n"
                    "import pallas_kernels._compat\nfrom pallas_kernels import rope\nrope._kernel\n"
                    "from pallas_kernels._compat import P\n")
    assert len(private_imports(bad)) == 5, private_imports(bad)
    good = ast.parse("from pallas_kernels.flash_common import LOG2E as _LOG2E\nfrom jax import _src\n"
                     "from __future__ import annotations\n")
    assert private_imports(good) == []
    assert imports_in_functions(ast.parse("def f():\n    from pallas_kernels import x\n")) == ["2: in f"]
    assert imports_in_functions(ast.parse("import jax\ndef f():\n    return jax\n")) == []
    # the samples are built, so this file does not carry the words it forbids
    session, issue = "ses" + "sion 9", "Iss" + "ue #20"
    assert WORK_LOG.search(f"as found in {session}") and WORK_LOG.search(issue) and DATE.search("(2026-12-01)")
