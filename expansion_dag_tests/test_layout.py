"""The package stays readable: no module imports one that imports it back (at run time or for type
checking alike), no class grows past one screenful of jobs, and the core stays free of Dagster."""

import ast
from pathlib import Path

import expansion_dag

PACKAGE = Path(expansion_dag.__file__).parent
#: The shell: what wires the core into Dagster. Everything else is the core, tested without it.
DAGSTER_SHELL = ("assets", "resources", "definitions.py", "schedules.py", "partitions.py", "cli.py")
MAX_CLASS_LINES = 200


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        targets |= {name for name in names if name in known}
    return targets


def test_no_module_imports_one_that_imports_it_back():
    found = modules()
    graph = {name: imports(tree, set(found)) - {name} for name, tree in found.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            current = todo.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(graph[current])
        return False

    # A package's __init__ re-exporting its own modules is not a circle of two units.
    circles = sorted(
        (a, b) for a in graph for b in graph[a]
        if a < b and reaches(b, a) and not (a.startswith(b + ".") or b.startswith(a + "."))
    )
    assert circles == []


def test_no_class_is_over_200_lines():
    long = [
        (name, node.name, node.end_lineno - node.lineno + 1)
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == []


def test_the_core_imports_no_dagster():
    core = {
        name: tree for name, tree in modules().items()
        if not name.removeprefix("expansion_dag.").startswith(DAGSTER_SHELL)
        and name.removeprefix("expansion_dag.").split(".")[0] + ".py" not in DAGSTER_SHELL
    }
    assert "expansion_dag.generation.engine" in core and "expansion_dag.defs.assets.completions" not in core
    with_dagster = sorted(
        name for name, tree in core.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(n == "dagster" or n.startswith("dagster.") or n.startswith("dagster_")
                for n in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]))
    )
    assert with_dagster == []
