"""The package's import graph has no cycle (every `import`/`from` statement, function-level ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_elastic"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file for every module and package under `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}.

    The rule for packages: importing `a.b.c` runs `a/__init__` and `a/b/__init__` first, so those
    count as edges (a package's re-exports are imports too), except from a module inside them:
    a module's own enclosing packages are already being imported when it runs, and importing
    through them (`from slurm_elastic.allocate import problem`, `import slurm_elastic.train.rng`)
    runs nothing. Taking a name that is no submodule from an enclosing package
    (`from slurm_elastic.allocate import solve` inside allocate/) reads the half-run __init__, and
    counts."""
    modules = module_names(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = graph[name]

        def add(target: str, line: int) -> None:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and prefix not in enclosing:
                    edges.setdefault(prefix, line)

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                add(source, node.lineno)
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        add(f"{source}.{alias.name}", node.lineno)
                    elif source in enclosing and source in modules:
                        edges.setdefault(source, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    steps = [] if cycle is None else [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    assert cycle is None, "import cycle:\n  " + "\n  ".join(steps)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_a_function_level_import_and_a_reexport_close_a_cycle(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "from pkg.a.problem import Problem\n",
        "pkg/a/problem.py": "class Problem:\n    def build(self):\n        from .state import build\n",
        "pkg/a/state.py": "from pkg.a.problem import Problem\n",
        "pkg/b.py": "from pkg.a import Problem\n",
    })
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["pkg.a.problem", "pkg.a.state", "pkg.a.problem"]
    assert "pkg.a.problem" in graph["pkg.a"] and "pkg.a" in graph["pkg.b"]   # the re-export is an edge


def test_importing_through_ones_own_package_is_no_cycle_but_taking_its_names_is(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "from pkg.a.solver import solve\n",
        "pkg/a/solver.py": "from pkg.a import problem\nimport pkg.a.problem\n",
        "pkg/a/problem.py": "",
    })
    assert find_cycle(import_graph(pkg)) is None
    (pkg / "a" / "problem.py").write_text("from pkg.a import solve\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.a.solver", "pkg.a.problem", "pkg.a"]
