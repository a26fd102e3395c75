"""The packages import in one direction: kvproto <- host_shim <- dpu_agent, spdk_plugins <-
dpu_agent; no cycle among them, and no runtime package imports test or benchmark support.

Scans every module's source with `ast` (imports under TYPE_CHECKING and inside functions
count too): an import cycle that only shows at run time still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
