"""The code's shape: modules form the layers of docs/architecture.md (tach checks them, configured in pyproject.toml),
no import cycle hides anywhere (a function-level import included), every module is in a layer, and modules,
classes and functions stay short enough to read whole."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from utils import REPO_ROOT

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader reads the layers from pyproject.toml")

MODULES = {  # dotted name -> path, for every module of the project outside tests/
    ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted(REPO_ROOT.rglob("*.py"))
    if not {"tests", ".cache", ".git"} & set(path.relative_to(REPO_ROOT).parts)
}
LONGEST_CLASS = 200  # lines: a screenful or two
LONGEST_FUNCTION = 80  # lines: one screenful
LONGEST_MODULE = 500  # lines: one concern, read top to bottom
LONG_MODULES = {  # the modules whose one concern needs more, each said in docs/architecture.md
    "core.losses": "the registry of every loss= option's formula, each a few lines beside its config",
}
TACH = dict(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["tach"])


def module_imports(path: Path) -> set[str]:
    """The project modules `path` imports, wherever the import stands: at module level, under TYPE_CHECKING, or
    inside a function (which runs later, on demand, and so can hide a cycle from Python but not from this).
    `from core import losses` imports core.losses."""
    names = set()
    for statement in ast.walk(ast.parse(path.read_text())):
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
    assert {"train", "trainers", "core.losses", "modeling.weights", "storage", "reporting.plots"} <= set(MODULES)
    assert module_imports(MODULES["core.objective"]) >= {"core.losses"}  # `from core.losses import ...`
    assert "storage" in module_imports(MODULES["persistence.checkpoint"])  # `import storage`
    assert "modeling.weights" in module_imports(MODULES["persistence.checkpoint"])  # `from modeling import weights`


def tach_check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tach", "check"], cwd=root, capture_output=True, text=True, timeout=120
    )


def test_every_import_runs_down_the_layers():
    result = tach_check(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_climbing_import_fails_the_layer_check_naming_both_modules(tmp_path):
    """A copy of the project in which core/losses.py imports the trainer inside a function, as a hidden cycle would:
    the check fails on that line, naming the module that climbs and the one it reaches."""
    for path in MODULES.values():
        copy = tmp_path / path.relative_to(REPO_ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    shutil.copyfile(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert tach_check(tmp_path).returncode == 0
    with (tmp_path / "core" / "losses.py").open("a") as losses:
        losses.write("\n\ndef climbing():\n    import trainers  # noqa\n")
    result = tach_check(tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode != 0
    assert "core/losses.py" in said and "'trainers'" in said and "'core'" in said, said


def test_every_module_is_in_a_layer():
    """Each top-level module and package of the project is one of tach's modules, with a layer: a new one cannot
    slip past the check. A module inside a package may have a layer of its own (judging.candidates), if it exists."""
    layered = {module["path"]: module.get("layer") for module in TACH["modules"]}
    tops, layered_tops = {name.split(".")[0] for name in MODULES}, {path for path in layered if "." not in path}
    gone = sorted(set(layered_tops) - tops) + sorted(path for path in layered if "." in path and path not in MODULES)
    assert tops == layered_tops and not gone, f"not in a layer: {sorted(tops - layered_tops)}; gone: {gone}"
    assert all(layer in TACH["layers"] for layer in layered.values())


def test_no_module_is_longer_than_one_concern():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: n for name, n in long.items() if n > LONGEST_MODULE and name not in LONG_MODULES}
    assert not long, long


def test_no_class_is_longer_than_a_screenful_or_two():
    long = {name: n for name, n in lengths((ast.ClassDef,)).items() if n > LONGEST_CLASS}
    assert not long, long


def test_no_function_is_longer_than_a_screenful():
    long = {name: n for name, n in lengths((ast.FunctionDef, ast.AsyncFunctionDef)).items() if n > LONGEST_FUNCTION}
    assert not long, long


MAPPED = {"bench", "scripts"}  # folders the map names as a whole (bench/), or whose modules it lists apart
MAP_ROW = re.compile(r"^\| `([\w/]+(?:\.py|/))`")  # a module map row: | `core/losses.py` | ... |


def mapped_modules(text: str) -> set[str]:
    """The module paths the first column of docs/architecture.md's module map names (`core/losses.py`, `bench/`)."""
    section = text.split("## The module map", 1)[1].split("\n## ", 1)[0]
    return {match.group(1) for line in section.splitlines() if (match := MAP_ROW.match(line))}


def map_problems(text: str, code: set[str]) -> list[str]:
    """What the module map of `text` gets wrong about the modules at the paths `code`: a module it does not name (in
    MAPPED's folders, only those it names one by one are looked for), a module or folder it names that is gone."""
    mapped = mapped_modules(text)
    named = {path for path in code if path.split("/")[0] not in MAPPED or path in mapped}
    exists = lambda path: path in code or path.endswith("/") and any(c.startswith(path) for c in code)  # noqa: E731
    return [f"does not name {path}" for path in sorted(named - mapped)] + [
        f"names {path}, which does not exist" for path in sorted(mapped) if not exists(path)
    ]


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    code = {str(path.relative_to(REPO_ROOT)) for path in MODULES.values() if path.name != "__init__.py"}
    problems = map_problems((REPO_ROOT / "docs" / "architecture.md").read_text(), code)
    assert not problems, f"docs/architecture.md's module map {'; '.join(problems)}"


def test_the_map_check_finds_a_module_missing_and_one_gone():
    rows = ["| `core/losses.py` | x |", "| `core/gone.py` | y |", "| `bench/` | z |"]
    text = "\n".join(["## The module map", "", "| module | owns |", "| --- | --- |", *rows, "", "## Next"])
    code = {"core/losses.py", "core/new.py", "bench/gpu.py", "bench/trl.py"}
    assert map_problems(text, code) == ["does not name core/new.py", "names core/gone.py, which does not exist"]
    assert map_problems(text.replace("core/gone.py", "core/new.py"), code) == []
