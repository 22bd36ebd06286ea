"""The package's shape, enforced: one folder per layer, no import cycle, small modules and
functions (the C++ kernels' files too), and ``Request`` changed only inside ``core``.

The import graph is test_layers.py's reading of the source (relative imports resolved, imports
under ``if TYPE_CHECKING:`` and inside functions counted: a lazy or type-only arrow is still an
arrow). Each checker below is also run on a small made-up source, so a broken checker fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.structure.test_layers import PACKAGE, REPO, find_imports, module_name

LAYERS = ("core", "tiering", "kernels", "runner", "models", "engine", "server", "sim", "bench")
# The public API and the command line; everything else lives in a layer's folder.
TOP_LEVEL = {"__init__.py", "cli.py", "errors.py", "inputs.py", "llm.py", "sampling_params.py"}
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def pagekv_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def kernel_sources() -> list[Path]:
    """The C++ kernels' sources and headers (csrc/ and its folders)."""
    csrc = PACKAGE / "kernels" / "csrc"
    return sorted(p for p in csrc.rglob("*") if p.suffix in (".cpp", ".h"))


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` it imports; ``sources``: name -> (text, is_package).

    ``from m import a`` is an arrow to ``m.a`` when that is a module, else to ``m``.
    """
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (text, is_package) in sources.items():
        for imp in find_imports(text, name, is_package):
            target = imp.module
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (N lines, line L)`` for each def longer than ``limit`` lines, nested ones too."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                out.append(f"{node.name} ({length} lines, line {node.lineno})")
    return out


def request_fields(source: str) -> set[str]:
    """The attributes ``Request`` sets on ``self`` (its fields)."""
    fields = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "Request":
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else []
                if isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and _is_self(t.value):
                        fields.add(t.attr)
    return fields


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def field_writes(source: str, fields: set[str]) -> list[str]:
    """``line N: x.f`` for each assignment to (or into, ``x.f[i] = ...``) a field of another
    object, and each in-place list call on one (``x.f.append(...)``)."""
    out = []
    mutators = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in mutators
        ):
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if (
                isinstance(target, ast.Attribute)
                and target.attr in fields
                and not _is_self(target.value)
            ):
                out.append(f"line {node.lineno}: {ast.unparse(target)}")
    return out


# --- the package ----------------------------------------------------------------------------


def test_each_layer_is_a_folder_and_the_top_level_is_the_public_api() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(LAYERS) <= folders, f"missing layer folders: {set(LAYERS) - folders}"
    assert folders <= set(LAYERS), f"folders that are no layer: {folders - set(LAYERS)}"
    loose = {p.name for p in PACKAGE.glob("*.py")} - TOP_LEVEL
    assert not loose, f"modules outside the layer folders: {sorted(loose)}"


def test_no_import_cycle_between_modules() -> None:
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in pagekv_files()}
    graph = import_graph(sources)
    assert sum(map(len, graph.values())) > 100  # the reading found the package's arrows
    assert not cycles(graph), "import cycles:\n" + "\n".join(map(str, cycles(graph)))


def test_modules_and_functions_are_small() -> None:
    too_long = []
    for path in pagekv_files():
        text = path.read_text()
        rel = path.relative_to(REPO)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {len(text.splitlines())} lines")
        too_long += [f"{rel}: def {f}" for f in long_functions(text)]
    assert not too_long, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function:\n"
        + "\n".join(too_long)
    )


def test_kernel_sources_are_small() -> None:
    sources = kernel_sources()
    assert any(p.parent.name == "arch" for p in sources) and len(sources) > 10
    too_long = [
        f"{p.relative_to(REPO)}: {n} lines"
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, f"C++ files over {MAX_MODULE_LINES} lines:\n" + "\n".join(too_long)


def test_request_fields_are_assigned_only_in_core() -> None:
    fields = request_fields((PACKAGE / "core" / "request.py").read_text())
    assert {"status", "num_computed_tokens", "all_token_ids", "held"} <= fields
    found = []
    for path in pagekv_files():
        if path.is_relative_to(PACKAGE / "core"):
            continue
        found += [f"{path.relative_to(REPO)}: {w}" for w in field_writes(path.read_text(), fields)]
    assert not found, "Request fields changed outside core:\n" + "\n".join(found)


# --- the checkers, on made-up sources -----------------------------------------------------------


def test_the_graph_reading_finds_type_only_and_lazy_arrows() -> None:
    sources = {
        "p": ("", True),
        "p.a": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n",
            False,
        ),
        "p.b": ("def f():\n    from . import c\n", False),
        "p.c": ("from p.a import thing\nimport os\n", False),
        "p.d": ("import p.c\n", False),
    }
    graph = import_graph(sources)
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.c"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    graph["p.c"] = set()  # break the circle: what remains is a chain
    assert cycles(graph) == []


def test_the_size_checker_counts_def_lines() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert long_functions(f"def short():\n{body[: -len('    x59 = 59') - 1]}") == []
    assert long_functions(f"def long():\n{body}") == ["long (61 lines, line 1)"]


def test_the_field_checker_sees_assignments_subscripts_and_list_calls() -> None:
    source = (
        "class Request:\n"
        "    def __init__(self):\n"
        "        self.status = 1\n"
        "        self.tokens: list[int] = []\n"
        "    def done(self):\n"
        "        self.status = 2\n"
    )
    fields = request_fields(source)
    assert fields == {"status", "tokens"}
    outside = (
        "r.status = 3\n"
        "r.tokens[-1] = 4\n"
        "a, r.status = 1, 2\n"
        "r.tokens.append(5)\n"
        "self.status = 0\n"
        "r.other = 1\n"
        "r.finish()\n"
    )
    assert field_writes(outside, fields) == [
        "line 1: r.status",
        "line 2: r.tokens",
        "line 3: r.status",
        "line 4: r.tokens",
    ]


def section_lines(markdown: str, heading: str) -> list[str]:
    """The lines under ``## heading`` up to the next ``## `` heading."""
    lines = markdown.splitlines()
    start = lines.index(f"## {heading}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def test_readme_performance_is_a_summary() -> None:
    """What runs, what to set and one dated table; the figures live in benchmarks/RESULTS.md."""
    performance = section_lines((REPO / "README.md").read_text(), "Performance")
    assert len(performance) <= 30, len(performance)
    assert any("benchmarks/RESULTS.md" in line for line in performance)
    with pytest.raises(ValueError):
        section_lines("## Use\ntext\n", "Performance")
