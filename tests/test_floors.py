"""The floors of the house, read from the source (ast only: nothing is imported, under a second).

Each module imports only from its own floor or below; the engines do not import each other; the
benchmark harness is imported by nothing but scripts and tests; the model's rules and mesh are
installed (`use_rules`) only where a program that traces model code is built. docs/architecture.md
explains the floors; a new module gets its floor here.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Longest prefix wins. Units on one floor may import each other, except on the engines' floor
# (SIBLINGS), whose units are independent of each other.
FLOORS = {
    "pallas_kernels": 0,                 # kernels: no mesh, no model
    "meshlab": 1,                        # blocks: the package's own modules (compat, xla_flags, ...)
    "meshlab.compat": 1,
    "meshlab.xla_flags": 1,
    "meshlab.mesh": 1,
    "meshlab.rules": 1,
    "meshlab.layout": 1,                 # spec trees, Layout
    "meshlab.parallel": 1,               # ring / Ulysses attention, pipeline executor, experts, grad sync
    "meshlab.peak": 1,                   # datasheet peak, MFU
    "meshlab.tokenizer": 1,
    "meshlab.checkpoint": 1,             # a run's on-disk format: training writes it, serving reads it
    "meshlab.profile_summary": 1,        # a profiler trace -> device time by kernel (train.py, the benchmarks)
    "models": 2,                         # registry (ModelDef), architectures, their counts
    "meshlab.plan": 3,                   # the planner: consulted by training before its first step
    "meshlab.train": 4,
    "meshlab.infer": 4,
    "meshlab.bench": 5,                  # the benchmark harness
    "scripts": 6,
    "tests": 6,
}
SIBLINGS = {"meshlab.train", "meshlab.infer"}
# No import goes up: the planner's check against the real compiled step lives in train/compiled.py.
EXCEPTIONS: dict = {}
BENCH_USERS = ("meshlab.bench", "scripts", "tests")   # tests: the harness has its own tests
# Who may enter `use_rules` (the context the model's constrain / materialize read while tracing).
USE_RULES = {
    "meshlab/layout.py": "Layout.active, entered by Layout.jit: the train step, the eval program and the "
                         "planner's loss-and-grads compile carry their own rules",
    "meshlab/infer/programs.py": "placement: the serving engine traces its prefill / decode programs under the "
                                 "serving rule file",
    "tests/models/test_moe.py": "runs the MoE layer by itself under each rule file (no step)",
    "tests/kernels/test_fused_ops.py": "resolves model.loss_softmax under a rule file by itself (no step)",
    "tests/parallel/test_ring_attention.py": "runs the model's forward by itself under a context rule file (no step)",
    "scripts/bench_pipeline.py": "times make_loss_and_grads alone (no step), jitted by hand",
    "notebooks/08_moe_routing.ipynb": "runs the MoE layer by itself under the ep rule file",
}
LIBRARY = ("pallas_kernels", "meshlab", "models")
SOURCES = LIBRARY + ("scripts", "tests")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _floor_unit(module: str):
    for n in range(module.count(".") + 1, 0, -1):
        unit = ".".join(module.split(".")[:n])
        if unit in FLOORS:
            return unit
    return None


def _imports(path: Path):
    """(imported module, line) for every import in the file, function-level ones included."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub if _is_module(sub) else base), node.lineno


def _files(tops=SOURCES):
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if ".ipynb_checkpoints" not in p.parts)


@pytest.fixture(scope="module")
def graph():
    """{importing module: [(imported module, line)]} for every source file, repo modules only."""
    g = {}
    for path in _files():
        g[_module(path)] = [(m, line) for m, line in _imports(path) if _floor_unit(m) is not None]
    return g


def test_every_library_module_has_a_floor():
    missing = [_module(p) for p in _files(LIBRARY) if _floor_unit(_module(p)) is None]
    assert not missing, f"give these a floor in FLOORS: {missing}"


def test_imports_go_down_the_floors(graph):
    bad = []
    for src, edges in graph.items():
        su = _floor_unit(src)
        for dst, line in edges:
            du = _floor_unit(dst)
            if any(src.startswith(a) and dst.startswith(b) for a, b in EXCEPTIONS):
                continue
            if FLOORS[du] > FLOORS[su]:
                bad.append(f"{src}:{line} imports {dst} (floor {FLOORS[du]} above its {FLOORS[su]})")
            elif su != du and su in SIBLINGS and du in SIBLINGS:
                bad.append(f"{src}:{line} imports {dst}: the engines are siblings")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules(graph):
    """Module-level (the exception included): a cycle would make the floors' order meaningless."""
    edges = {src: {d for d, _ in ds if d != src} for src, ds in graph.items() if _floor_unit(src).split(".")[0] != "tests"}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d in edges and not state.get(d):
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(edges):
        if not state.get(m):
            visit(m)


def test_the_compiled_check_is_used_by_scripts_and_tests_only(graph):
    """meshlab.train.compiled compiles steps to be read (memory, HLO): the training path never reaches it."""
    users = sorted({src for src, ds in graph.items() for d, _ in ds if d == "meshlab.train.compiled"
                    and _floor_unit(src) not in ("scripts", "tests") and src != "meshlab.train.compiled"})
    assert not users, f"{users} import meshlab.train.compiled (the planner's check against the compiler)"


def test_only_scripts_and_tests_import_the_bench_wing(graph):
    bad = [f"{src}:{line} imports {dst}" for src, ds in graph.items() for dst, line in ds
           if dst.startswith("meshlab.bench") and not src.startswith(BENCH_USERS)]
    assert not bad, "the library must not depend on its benchmarks:\n" + "\n".join(bad)


def _use_rules_calls(text: str) -> int:
    n = 0
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "use_rules") or (isinstance(f, ast.Attribute) and f.attr == "use_rules"):
                n += 1
    return n


def test_use_rules_is_entered_only_where_programs_are_built():
    found = {}
    for path in _files():
        if _use_rules_calls(path.read_text()):
            found[str(path.relative_to(ROOT))] = True
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.split("\n") if not line.lstrip().startswith(("%", "!")))
        if _use_rules_calls(code):
            found[str(nb.relative_to(ROOT))] = True
    extra = sorted(set(found) - set(USE_RULES))
    assert not extra, (f"{extra} enter use_rules; a program built by make_train_step or Layout.jit carries its "
                       "own rules and mesh, so callers install nothing (or add the file to USE_RULES with why)")
    stale = sorted(set(USE_RULES) - set(found))
    assert not stale, f"USE_RULES names files that no longer enter use_rules: {stale}"
