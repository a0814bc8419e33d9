"""The package shows its architecture and stays readable.

Every module sits in a folder of the layers docs/development.md draws, and a folder imports only the
folders below it; each folder has a front door (its ``__init__``, with ``__all__``) that the other
folders, the tests and the benchmarks import from. No module imports one that imports it back, no
module grows past 600 lines nor its docstring past 25, no class past one screenful of jobs, and the
layers under the Dagster shell import no Dagster.
"""

import ast
import functools
import importlib
from pathlib import Path

import pytest

import expansion_dag

PACKAGE = Path(expansion_dag.__file__).parent
ROOT = PACKAGE.parent
#: The layers, bottom first: a folder imports its own modules and the folders before it, never after.
LAYERS = ("core", "store", "prompts", "servers", "training", "generation", "config", "defs", "cli")
#: Beside the layers: the simulator stands on the core alone (the product starts it as a process,
#: never imports it). So it reads the servers' contracts its own way, never with the client's wire
#: types: a misreading shared by both would pass every test that pits one against the other.
SIDE = {"sim": {"core"}}
#: Modules at the top, outside any folder: Dagster's one root of definitions, which wires them all
#: and, for the direction between folders, counts as the shell's (the CLI runs it).
TOP_LEVEL = {"expansion_dag", "expansion_dag.definitions"}
#: The Dagster shell: what wires the layers into Dagster. Everything under it is tested without it.
DAGSTER_SHELL = {"defs", "cli"}
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 200
#: A module's docstring says what it is and why, briefly; the rest belongs in docs/.
MAX_DOCSTRING_LINES = 25


@functools.cache
def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def folder(name: str) -> str:
    """The layer (or side folder) a module sits in: the first name under the package."""
    if name == "expansion_dag.definitions":
        return "defs"
    return name.split(".")[1] if name.count(".") else ""


def imported(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Each ``from expansion_dag... import names`` and ``import expansion_dag...`` of a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "expansion_dag":
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "expansion_dag"]
    return found


def targets(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules a module imports (a name that is a submodule counts as that module)."""
    found = set()
    for module, names in imported(tree):
        found |= {name for name in (module, *(f"{module}.{n}" for n in names)) if name in known}
    return found


@functools.cache
def packages() -> set[str]:
    return {name for name in modules() if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}


def test_every_module_sits_in_a_folder_of_the_drawn_layers():
    stray = sorted(
        name for name in modules()
        if name not in TOP_LEVEL and folder(name) not in (*LAYERS, *SIDE)
    )
    assert stray == [], "each module belongs in a layer's folder (docs/development.md, 'Layout')"


def test_a_folder_imports_only_the_folders_below_it():
    allowed = {layer: set(LAYERS[: i + 1]) for i, layer in enumerate(LAYERS)}
    allowed |= {side: below | {side} for side, below in SIDE.items()}
    found = modules()
    upward = sorted(
        (name, target)
        for name, tree in found.items() if name not in TOP_LEVEL
        for target in targets(tree, set(found))
        if target != "expansion_dag" and folder(target) not in allowed[folder(name)]
    )
    assert upward == []


def test_each_folder_has_a_front_door_naming_what_the_others_may_use():
    for package in sorted(packages() - TOP_LEVEL):
        module = importlib.import_module(package)
        exported = getattr(module, "__all__", None)
        assert exported, f"{package} has no __all__"
        assert sorted(exported) == sorted(set(exported)), package
        missing = [name for name in exported if not hasattr(module, name)]
        assert missing == [], f"{package}.__all__ names what it does not have"


def front_door_misses(names_by_file: dict[str, ast.Module], importer_package) -> list[str]:
    """Imports that reach past another folder's front door into its modules for a public name."""
    doors, known = packages(), set(modules())
    misses = []
    for name, tree in names_by_file.items():
        own = importer_package(name)
        for module, names in imported(tree):
            door = module if module in doors else module.rsplit(".", 1)[0]
            if module in doors or door in (own, "expansion_dag") or door not in doors:
                continue
            public = [n for n in names if not n.startswith("_") and f"{module}.{n}" not in known]
            if public:
                misses.append(f"{name}: from {module} import {', '.join(public)}")
    return sorted(misses)


def test_the_folders_import_each_other_through_their_front_doors():
    found = modules()
    # A module's own folder is its package; it imports its siblings directly.
    own = {name: name if name in packages() else name.rsplit(".", 1)[0] for name in found}
    assert front_door_misses(found, own.__getitem__) == []
    private = sorted(
        f"{name}: {module} {n}"
        for name, tree in found.items()
        for module, names in imported(tree)
        for n in names
        if n.startswith("_") and folder(module) != folder(name)
    )
    assert private == [], "another folder's private names are its own"


#: The layer whose folders are its jobs (docs/development.md, "Layout"): each job a folder with a
#: front door, through which alone the others reach it.
SERVERS = "expansion_dag.servers"


def servers_job(name: str) -> str:
    """The job folder of a module of servers/ (``expansion_dag.servers.wire``)."""
    return ".".join(name.split(".")[:3])


def test_each_job_of_servers_reaches_another_only_through_that_jobs_front_door():
    found = modules()
    inside = [name for name in found if name.startswith(SERVERS + ".")]
    loose = sorted(name for name in inside if servers_job(name) not in packages())
    assert inside and loose == [], "each module of servers/ sits in the folder of its job"
    reaching = []
    for name in inside:
        own = servers_job(name)
        for module, names in imported(found[name]):
            if module.split(".")[:3] == own.split(".") or not module.startswith(SERVERS):
                continue
            through_door = module == servers_job(module) != SERVERS and not any(
                n.startswith("_") or f"{module}.{n}" in found for n in names
            )
            if not through_door:
                reaching.append(f"{name}: {module} {', '.join(names)}".strip())
    # The layer's own front door re-exports the jobs: a job that imports it goes round in a circle.
    assert reaching == []


def test_the_other_layers_reach_servers_through_its_front_door():
    found = modules()
    past = sorted(
        f"{name}: {module}"
        for name, tree in found.items() if not name.startswith(SERVERS)
        for module, _ in imported(tree) if module.startswith(SERVERS + ".")
    )
    assert past == []


@pytest.mark.parametrize("where", ["expansion_dag_tests", "bench"])
def test_tests_and_benchmarks_use_the_front_doors_for_public_names(where):
    files = {
        str(path.relative_to(ROOT)): ast.parse(path.read_text(), filename=str(path))
        for path in sorted((ROOT / where).rglob("*.py"))
    }
    assert files
    assert front_door_misses(files, lambda _name: None) == []


def test_no_module_imports_one_that_imports_it_back():
    found = modules()
    graph = {name: targets(tree, set(found)) - {name} for name, tree in found.items()}

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


def test_no_module_is_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_module_docstring_is_over_25_lines():
    long = {
        name: lines for name, tree in modules().items()
        if (doc := ast.get_docstring(tree, clean=False)) and (lines := len(doc.splitlines())) > MAX_DOCSTRING_LINES
    }
    assert long == {}


def test_no_class_is_over_200_lines():
    long = [
        (name, node.name, node.end_lineno - node.lineno + 1)
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == []


def test_the_layers_under_the_shell_import_no_dagster():
    core = {
        name: tree for name, tree in modules().items()
        if folder(name) not in DAGSTER_SHELL
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


BENCH = ROOT / "bench"


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of a module's docstring nodes: text about other files, not code that uses them."""
    scopes = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    bodies = [tree, *(n for n in ast.walk(tree) if isinstance(n, scopes))]
    return {
        id(body.body[0].value) for body in bodies
        if body.body and isinstance(body.body[0], ast.Expr) and isinstance(body.body[0].value, ast.Constant)
    }


def test_no_test_imports_or_runs_a_benchmark():
    """A test that needs a benchmark's workload imports it from ``expansion_dag_tests/workloads/``,
    where the benchmark imports it too: a benchmark is free to change how it measures without
    breaking a test."""
    scripts = {path.stem for path in BENCH.glob("*.py")}
    assert scripts, "no benchmark found: the rule would hold of nothing"
    found = []
    # This module reads the benchmarks' source, to hold them to the rules here; it runs none.
    for path in sorted(set((ROOT / "expansion_dag_tests").rglob("*.py")) - {Path(__file__).resolve()}):
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                # A path to a script: the folder as one part of it, or a script's file name.
                if node.value == "bench" or any(f"{script}.py" in node.value for script in scripts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
                continue
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {m}" for m in modules
                      if m.split(".")[0] in scripts | {"bench"}]  # fmt: skip
    assert found == []


def test_benchmarks_reach_no_private_name():
    """A benchmark measures the package and its dependencies through their public APIs: it neither
    imports nor reads nor replaces a private name (a function to time it, httpx's ``_pool``), so an
    upgrade or a refactoring that keeps the public API keeps the benchmarks running."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute):  # of anything but the benchmark's own objects
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                names = [] if own else [node.attr]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if any(part.startswith("_") and not part.endswith("__") for part in n.split("."))]  # fmt: skip
    assert found == []


#: Dagster's layers beneath its public API, reached through public-looking names: the instance's
#: storages (Dagster+ refuses their methods) and a job's asset layer. Each held only while the pin did.
DAGSTER_INTERNALS = {"event_log_storage", "run_storage", "schedule_storage", "asset_layer"}


def dagster_internals(tree: ast.Module) -> list[str]:
    """A module's uses of Dagster's private layer: a ``dagster._`` (or ``dagster_*._``) import, a
    private name imported from Dagster, ``dg._...``, or one of :data:`DAGSTER_INTERNALS`."""

    def private(module: str) -> bool:
        parts = module.split(".")
        return parts[0].startswith("dagster") and any(p.startswith("_") for p in parts[1:])

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dagster"):
            names = [a.name for a in node.names]
            if private(node.module) or any(n.startswith("_") for n in names):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and (
            node.attr in DAGSTER_INTERNALS
            or (node.attr.startswith("_") and isinstance(node.value, ast.Name) and node.value.id in ("dg", "dagster"))
        ):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("where", ["expansion_dag", "expansion_dag_tests", "bench"])
def test_dagster_is_used_through_its_public_api_only(where):
    private = {
        str(path.relative_to(ROOT)): uses
        for path in sorted((ROOT / where).rglob("*.py"))
        if (uses := dagster_internals(ast.parse(path.read_text(), filename=str(path))))
    }
    assert private == {}, "Dagster's private layer changes with any upgrade: use its public API"


#: A lower layer's default named like a schema field but meaning another thing, with the reason.
OTHER_MEANING = {
    ("core/modes.py", "seed"): "the seed of each prompt's draw among modes (generation.mode_seed), not sampling's",
    ("prompts/catalog.py", "seed"): "a catalog file's own selection seed, not sampling's",
    ("generation/dispatch.py", "mode"): "a prompt's generation mode, not the fleet's mode",
    ("training/manifest.py", "modes"): "the modes a built set holds, as its manifest reports them",
    ("servers/probing/fleet.py", "stream_interval"): "what a server streams when it says nothing: every token",
    ("generation/engine_config.py", "stream_interval"): "what a server streams when it says nothing: every token",
}


def schema_fields_with_defaults() -> set[str]:
    import pydantic

    from expansion_dag.config import schema

    return {
        field
        for model in vars(schema).values()
        if isinstance(model, type) and issubclass(model, pydantic.BaseModel) and model.__module__ == schema.__name__
        for field, info in model.model_fields.items()
        if not info.is_required()
    }


def stated_defaults(tree: ast.Module):
    """(line, name, default) of each class field and keyword with a default in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    yield item.lineno, item.target.id, item.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]  # fmt: skip
            yield from ((arg.lineno, arg.arg, default) for arg, default in pairs if default is not None)


def test_no_default_of_the_schema_is_said_again_below_it():
    """Each default is said once, in the run configuration's schema: a layer below it (and the
    shell's resources, which take ``schema_default``) takes the value and states none of its own.
    ``None`` says "not given", not a value; a name that means another thing is listed above."""
    fields = schema_fields_with_defaults()
    assert {"max_output_tokens", "temperature", "max_attempts", "stream_interval"} <= fields
    below = [*LAYERS[: LAYERS.index("config")], "defs"]
    repeated = []
    for folder in below:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            where = path.relative_to(PACKAGE).as_posix()
            for line, name, default in stated_defaults(ast.parse(path.read_text(), filename=str(path))):
                is_none = isinstance(default, ast.Constant) and default.value is None
                from_schema = isinstance(default, ast.Call) and "schema_default" in ast.unparse(default)
                # pydantic's Field(description=...) alone is a required field, with no default.
                required = (isinstance(default, ast.Call) and ast.unparse(default.func).endswith("Field")
                            and not default.args and not {"default", "default_factory"} & {k.arg for k in default.keywords})  # fmt: skip
                if name in fields and not (is_none or from_schema or required) and (where, name) not in OTHER_MEANING:
                    repeated.append(f"{where}:{line}: {name} = {ast.unparse(default)[:60]}")
    assert repeated == []


#: Where a server backend may be named in the product: its row of the table of differences, the run
#: configuration's schema (the choices a user types) and the simulator (which plays each backend).
NAMES_BACKENDS = ("expansion_dag.servers.dialects.table", "expansion_dag.config.schema")


def test_a_backend_is_named_only_in_the_dialect_table_the_schema_and_the_simulator():
    """A new backend is its dialect row (its launch recipe with it) and the simulator's: no list of
    backends, and no ``if`` on one, anywhere else."""
    from expansion_dag.servers import BACKENDS

    naming = sorted(
        f"{name}:{node.lineno}: {node.value!r}"
        for name, tree in modules().items()
        if name not in NAMES_BACKENDS and folder(name) != "sim"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in BACKENDS
    )
    assert naming == []

