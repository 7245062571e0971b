"""The code's shape: modules form layers (no import cycle, so none points up) and classes stay short enough to read
whole."""

import ast
from pathlib import Path

from utils import REPO_ROOT

MODULES = {  # dotted name -> path, for every module of the project outside tests/
    ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted(REPO_ROOT.rglob("*.py"))
    if not {"tests", ".cache", ".git"} & set(path.relative_to(REPO_ROOT).parts)
}
LONGEST_CLASS = 200  # lines: a screenful or two
LONGEST_FUNCTION = 80  # lines: one screenful


def module_imports(path: Path) -> set[str]:
    """The project modules `path` imports when it is imported: at module level, TYPE_CHECKING blocks included
    (imports inside functions run later, on demand). `from core import losses` imports core.losses."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        for statement in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(statement, ast.Import):
                names.update(alias.name for alias in statement.names)
            elif isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                names.add(statement.module)
                names.update(f"{statement.module}.{alias.name}" for alias in statement.names)
    return names & MODULES.keys()


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None (depth-first search)."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return None


def test_modules_import_without_a_cycle():
    graph = {name: module_imports(path) - {name} for name, path in MODULES.items()}
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


def lengths(kinds: tuple[type, ...]) -> dict[str, int]:
    """{module.name: lines} of every definition of these kinds in the project, nested ones included."""
    return {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, kinds)
    }


def test_the_project_is_found_in_its_packages():
    assert {"train", "trainers", "core.losses", "modeling.weights", "persistence.storage", "reporting.plots"} <= set(
        MODULES
    )
    assert module_imports(MODULES["core.objective"]) >= {"core.losses"}  # `from core.losses import ...`
    assert "persistence.storage" in module_imports(MODULES["persistence.checkpoint"])  # `from persistence import`


def test_no_class_is_longer_than_a_screenful_or_two():
    long = {name: n for name, n in lengths((ast.ClassDef,)).items() if n > LONGEST_CLASS}
    assert not long, long


def test_no_function_is_longer_than_a_screenful():
    long = {name: n for name, n in lengths((ast.FunctionDef, ast.AsyncFunctionDef)).items() if n > LONGEST_FUNCTION}
    assert not long, long
