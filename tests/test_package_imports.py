"""The packages import in one direction: kvproto <- host_shim <- dpu_agent, spdk_plugins <-
dpu_agent; no cycle among them, and no runtime package imports test or benchmark support.

Scans every module's source with `ast` (imports under TYPE_CHECKING and inside functions
count too): an import cycle that only shows at run time still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvproto", "host_shim", "spdk_plugins", "dpu_agent")
# What each package may import among PACKAGES (the rule in the developers' guide).
ALLOWED = {
    "kvproto": set(),
    "host_shim": {"kvproto"},
    "spdk_plugins": {"kvproto"},
    "dpu_agent": {"kvproto", "host_shim", "spdk_plugins"},
}
TEST_SUPPORT = ("tests", "spdk_sim", "spdk_peer", "conftest", "pytest")


def _imports(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (absolute imports only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> modules that import it."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in _imports(path):
                if name != pkg and (name in PACKAGES or name in TEST_SUPPORT):
                    graph[pkg].setdefault(name, []).append(str(path.relative_to(ROOT)))
    return graph


def test_packages_import_only_in_the_allowed_direction() -> None:
    bad = {
        f"{pkg} -> {dep}": where
        for pkg, deps in _graph().items()
        for dep, where in deps.items()
        if dep in PACKAGES and dep not in ALLOWED[pkg]
    }
    assert not bad, bad


def test_no_import_cycle_among_packages() -> None:
    graph = {p: {d for d in deps if d in PACKAGES} for p, deps in _graph().items()}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(p: str, path: list[str]) -> None:
        state[p] = 1
        for d in sorted(graph[p]):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, p, d])}"
            if d not in state:
                visit(d, [*path, p])
        state[p] = 2

    for p in PACKAGES:
        if p not in state:
            visit(p, [])


def test_runtime_packages_import_no_test_support() -> None:
    bad = {
        f"{pkg} -> {dep}": where
        for pkg, deps in _graph().items()
        for dep, where in deps.items()
        if dep in TEST_SUPPORT
    }
    assert not bad, bad


def test_the_scan_sees_an_import_cycle(tmp_path: Path) -> None:
    """The scanner itself: a module importing another package is found (not a test that
    cannot fail)."""
    mod = tmp_path / "m.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dpu_agent.log import x\n"
        "def f():\n    import host_shim.nvme\n"
    )
    assert {"dpu_agent", "host_shim"} <= _imports(mod)


def _modules(package_dir: Path, root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `package_dir` (a package in `root`)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that runs: module level and inside functions, but not the bodies of
    `if TYPE_CHECKING:` (imports there only name types for the checker, never execute)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _import_graph(package_dir: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (absolute and relative; a name
    imported from a package counts as that submodule when one exists, else as the package)."""
    modules = _modules(package_dir, root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        graph[mod].add(f"{base}.{a.name}")
                    elif base in modules:
                        graph[mod].add(base)
        graph[mod].discard(mod)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


@pytest.mark.parametrize("package", ["dpu_agent/nvmf", "dpu_agent/engine", "host_shim"])
def test_no_import_cycle_inside_package(package: str) -> None:
    """Modules of one package import each other in one direction: no module needs another
    that needs it back, at module level or inside a function (a lazy import only moves the
    cycle to run time)."""
    cycles = {tuple(c) for c in _cycles(_import_graph(ROOT / package))}
    assert not cycles, "\n".join(" -> ".join(c) for c in sorted(cycles))


def test_the_module_scan_sees_cycles_lazy_and_relative(tmp_path: Path) -> None:
    """The scanner itself: a cycle through a function-level and a relative import is found;
    one through an `if TYPE_CHECKING:` import is not a cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.a import x\n")  # fmt: skip
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = _import_graph(pkg, tmp_path)
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


# Only test and benchmark code may use the harness; the agent itself never starts agents.
TESTING_MAY_IMPORT = ("dpu_agent/bench/",)


def test_runtime_never_imports_the_test_harness() -> None:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "dpu_agent/testing.py" or rel.startswith(TESTING_MAY_IMPORT):
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                if "dpu_agent.testing" in names:
                    bad.append(rel)
    assert not bad, f"runtime modules import dpu_agent.testing: {sorted(set(bad))}"
