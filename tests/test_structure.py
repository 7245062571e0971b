"""The code's shape: modules form layers (no import cycle, so none points up) and classes stay short enough to read
whole."""

import ast
from pathlib import Path

from utils import REPO_ROOT

MODULES = {path.stem: path for path in REPO_ROOT.glob("*.py")}
LONGEST_CLASS = 210  # lines: "about 200", a screenful or two


def module_imports(path: Path) -> set[str]:
    """The project modules `path` imports when it is imported: at module level, TYPE_CHECKING blocks included
    (imports inside functions run later, on demand)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        for statement in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(statement, ast.Import):
                names.update(alias.name.split(".")[0] for alias in statement.names)
            elif isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                names.add(statement.module.split(".")[0])
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


def test_no_class_is_longer_than_a_screenful_or_two():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LONGEST_CLASS
    ]
    assert not long, long
