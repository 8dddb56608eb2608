"""No import cycles among swift_megatron's modules, and imports that go down the package layers
(issue 44), read from the source with `ast`.

Every `import` and `from ... import` of a swift_megatron module counts, at module level or inside
a function (an import moved into a function still closes the circle). `from pkg import name`
counts as an import of `pkg.name` when that is a module, else of `pkg`; the package `__init__`s
Python runs on the way to a module are not counted. `cli/` is read as `swift_megatron.cli`, the
name it is installed under. There is no cycle left: a new one fails the test.

LAYERS lists the packages from the bottom up (docs/architecture.md draws the same map): a
module imports from its own layer or below. At most MAX_UPWARD import statements go up a layer,
each marked with a `# upward: why` comment on its line or in the comment right above; a new
package must be given a layer.
"""
import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"swift_megatron": "swift_megatron", "cli": "swift_megatron.cli"}  # folder -> name

LAYERS = [   # bottom to top; a top-level module (errors.py) is named like a package
    ("swift_megatron", "errors", "paths", "platform", "logging", "launch"),
    ("arguments",),
    ("parallel", "report"),
    ("model",),
    ("bridge",),
    ("lora", "training"),
    ("checkpoint", "data", "rewards"),
    ("export", "rollout", "compat"),
    ("rlhf", "preflight"),
    ("planning", "demo", "fixtures"),
    ("cli",),
]
MAX_UPWARD = 3
UPWARD_MARK = "# upward:"

Graph = Dict[str, Set[str]]


def module_files() -> Dict[str, Path]:
    """Module name -> source file of every module of the packages (a package: its __init__)."""
    files = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([name] + parts)] = path
    return files


Statements = List[Tuple[ast.stmt, Set[str]]]


def import_statements(module: str, path: Path, modules: Set[str]) -> Statements:
    """Every import statement of `module` anywhere in its source, with the dotted names it
    imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.append((node, {alias.name for alias in node.names}))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.append((node, {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                                 else base for alias in node.names}))
    return found


def imported_names(module: str, path: Path, modules: Set[str]) -> Set[str]:
    """The dotted names `module` imports anywhere in its source."""
    return set().union(*(names for _, names in import_statements(module, path, modules)))


def owning_module(name: str, modules: Set[str]) -> str:
    """The module `name` lies in: itself, or the longest module prefix of it ("" if none)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph(files: Dict[str, Path]) -> Graph:
    modules = set(files)
    graph = {}
    for module, path in files.items():
        targets = {owning_module(name, modules) for name in imported_names(module, path, modules)}
        graph[module] = targets - {"", module}
    return graph


def cycles(graph: Graph) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[Set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(component: Set[str], graph: Graph) -> str:
    return "\n".join(f"  {m} -> {sorted(graph[m] & component)}" for m in sorted(component))


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [{"a", "b", "c"}]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [{"a", "b"}, {"c", "d"}]),
])
def test_cycles_finds_every_cycle(graph, expected):
    assert sorted(map(sorted, cycles(graph))) == sorted(map(sorted, expected))


def test_imports_inside_functions_and_from_package_imports_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from swift_megatron.rewards import registry, load_plugins\n"
                      "def f():\n    import swift_megatron.errors\n")
    modules = {"swift_megatron.rewards", "swift_megatron.rewards.registry",
               "swift_megatron.errors"}
    assert imported_names("swift_megatron.x.m", source, modules) == {
        "swift_megatron.rewards.registry", "swift_megatron.rewards", "swift_megatron.errors"}


def test_no_import_cycles():
    graph = import_graph(module_files())
    assert "swift_megatron.cli.main" in graph and "swift_megatron.rewards.registry" in graph
    found = cycles(graph)
    assert not found, "import cycle(s):\n" + "\n\n".join(describe(c, graph) for c in found)


def layer_of(module: str) -> int:
    """The index in LAYERS of the package (or top-level module) `module` belongs to."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return next(i for i, packages in enumerate(LAYERS) if name in packages)


def marked(lines: List[str], node: ast.stmt) -> bool:
    """Whether the statement's lines or the comment lines right above it carry UPWARD_MARK."""
    first = node.lineno - 1
    while first > 0 and lines[first - 1].lstrip().startswith("#"):
        first -= 1
    return any(UPWARD_MARK in line for line in lines[first:node.end_lineno])


def upward_imports(files: Dict[str, Path]) -> List[Tuple[str, int, str, bool]]:
    """(module, line, imported module, marked) of every import statement that goes up a layer."""
    modules, found = set(files), []
    for module, path in files.items():
        lines = path.read_text().splitlines()
        for node, names in import_statements(module, path, modules):
            targets = {owning_module(name, modules) for name in names} - {"", module}
            up = sorted(t for t in targets if layer_of(t) > layer_of(module))
            if up:
                found.append((module, node.lineno, up[0], marked(lines, node)))
    return found


def test_every_package_has_a_layer():
    named = {name for packages in LAYERS for name in packages}
    for module in module_files():
        parts = module.split(".")
        assert (parts[1] if len(parts) > 1 else parts[0]) in named, f"{module}: add it to LAYERS"


def test_imports_go_down_the_layers_but_a_few_marked_ones():
    upward = upward_imports(module_files())
    lines = "\n".join(f"  {m}:{line} -> {t}" for m, line, t, _ in upward)
    unmarked = [(m, line, t) for m, line, t, ok in upward if not ok]
    assert not unmarked, f"upward import(s) without a '{UPWARD_MARK} why' comment: {unmarked}"
    assert len(upward) <= MAX_UPWARD, f"{len(upward)} upward imports (max {MAX_UPWARD}):\n{lines}"


def test_the_mark_counts_on_the_line_or_in_the_comment_above():
    source = ("import os\n# upward: why\n# more why\nfrom x import y\n"
              "from z import w  # upward: why\nimport q\n")
    lines = source.splitlines()
    assert [marked(lines, node) for node in ast.parse(source).body] == [False, True, True, False]
