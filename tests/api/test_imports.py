"""Import structure: python/fmha has no import cycle, and no test module imports another.

Both are read from the source with ``ast`` (nothing is imported), counting imports inside
functions too: a lazy import only hides a cycle until the first call that takes that path.
Tests share cases through tests/cases.py and tests/conftest.py, never through each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "python" / "fmha"
TESTS_DIR = ROOT / "tests"

#: Compiled modules of the package (built by CMake, no .py source): leaves of the graph.
EXTENSIONS = ("_C", "_cuda_emu")


def _module_names(package_dir: Path) -> dict:
    """{dotted module name: source path} for every .py file of the package."""
    top = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (top,) + path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    for ext in EXTENSIONS:
        out.setdefault(f"{top}.{ext}", None)
    return out


def _imports(tree: ast.AST, module: str, is_package: bool, modules: dict) -> set:
    """The package's modules that ``module`` imports anywhere in its source."""
    found = set()
    own_package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # `import a.b.c` imports a, a.b and a.b.c
                found.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from p import m` imports the submodule m when there is one, else reads an
                # attribute of p (which must then be imported)
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != module}


def import_graph(package_dir: Path) -> dict:
    """{module: set of the package's modules it imports}."""
    modules = _module_names(package_dir)
    graph = {}
    for name, path in modules.items():
        if path is None:
            graph[name] = set()
            continue
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = _imports(tree, name, path.name == "__init__.py", modules)
    return graph


def find_cycle(graph: dict):
    """A list [a, b, ..., a] of modules that import each other in a ring, or None."""
    state = {}  # absent: unvisited, 1: on the current path, 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_import_graph_sees_the_package():
    """The graph is not vacuous: it holds the modules and the edges we know of."""
    graph = import_graph(PACKAGE_DIR)
    assert {"fmha", "fmha._api", "fmha._core", "fmha._torch", "fmha._validate"} <= set(graph)
    assert {"fmha._core", "fmha._validate"} <= graph["fmha._api"]
    assert {"fmha._core", "fmha._validate"} <= graph["fmha._torch"]
    assert "fmha._api" in graph["fmha.integrations.transformers"]


def test_find_cycle_finds_lazy_cycles():
    """An import inside a function counts: the checker sees a ring closed lazily."""
    code_a = "from . import b\n"
    code_b = "def f():\n    from .a import g\n    return g\n"
    modules = {"p": None, "p.a": None, "p.b": None}
    graph = {"p": set(),
             "p.a": _imports(ast.parse(code_a), "p.a", False, modules),
             "p.b": _imports(ast.parse(code_b), "p.b", False, modules)}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]


def test_package_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE_DIR))
    assert cycle is None, "import cycle in python/fmha: " + " -> ".join(cycle)


def _test_module_imports(path: Path, test_modules: set) -> list:
    """Names of test modules that the file at ``path`` imports (anywhere in it)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        hits += [n for n in names if n.split(".")[0] in test_modules]
    return hits


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in TESTS_DIR.rglob("test_*.py")}
    assert "test_imports" in test_modules
    offenders = {}
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        hits = _test_module_imports(path, test_modules)
        if hits:
            offenders[path.name] = hits
    assert not offenders, ("test modules import other test modules (share cases through "
                           f"tests/cases.py or conftest.py instead): {offenders}")


def test_test_module_check_sees_imports(tmp_path):
    """The check catches every form (plain, from, star, inside a function) and lets the
    shared helpers through."""
    mods = {"test_a", "test_b"}
    path = tmp_path / "test_c.py"
    for code in ("import test_a\n", "from test_a import x\n", "from test_b import *\n",
                 "def f():\n    import test_b as cpu\n"):
        path.write_text(code)
        assert _test_module_imports(path, mods), code
    path.write_text("import cases\nfrom conftest import assert_close\nimport fmha\n")
    assert _test_module_imports(path, mods) == []
