"""The layer arrows of DESIGN.md, enforced: ``core`` stays torch-free, nothing imports upwards.

One rule table, checked by walking the ``ast`` of every file under pagekv/. A rule governs a
package (or module) and forbids import prefixes, or allows only some pagekv modules. Relative
imports are resolved; ``importlib.import_module("...")`` and ``__import__("...")`` with a
literal name count as imports. Imports under ``if TYPE_CHECKING:`` never run, but still count
for rules that apply everywhere (a type-only arrow is still an arrow).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pagekv"

UPWARD = ("pagekv.server", "pagekv.cli", "pagekv.engine", "pagekv.llm")


@dataclass(frozen=True)
class Rule:
    name: str
    scope: str  # the package or module the rule governs
    forbidden: tuple[str, ...] = ()  # import prefixes it may not use
    only_pagekv: tuple[str, ...] | None = None  # if set, the only pagekv modules it may use
    module_level_only: bool = False  # only imports that run at import time count
    required: bool = False  # the scope must exist; otherwise the rule is skipped


RULES = (
    Rule(
        "core imports no torch, numpy or higher layer",
        "pagekv.core",
        forbidden=(
            "torch",
            "numpy",
            "pagekv.runner",
            "pagekv.models",
            "pagekv.tiering",
            *UPWARD,
        ),
        required=True,
    ),
    Rule(
        "errors (imported by core) imports nothing of pagekv",
        "pagekv.errors",
        forbidden=("torch", "numpy"),
        only_pagekv=(),
        required=True,
    ),
    Rule(
        "sampling_params (imported by core) needs only errors",
        "pagekv.sampling_params",
        forbidden=("torch", "numpy"),
        only_pagekv=("pagekv.errors",),
        required=True,
    ),
    Rule(
        "tiering moves bytes: no model code, no tensors (the runner's stay the runner's)",
        "pagekv.tiering",
        forbidden=("torch", "pagekv.models", "pagekv.runner", *UPWARD),
        required=True,
    ),
    Rule(
        "server talks only to the engine (and the plain types the engine takes and returns)",
        "pagekv.server",
        only_pagekv=(
            "pagekv.engine",
            "pagekv.engine.config",
            "pagekv.server",
            "pagekv.errors",
            "pagekv.sampling_params",
            "pagekv.engine.outputs",
        ),
    ),
    Rule("runner imports no higher layer", "pagekv.runner", forbidden=UPWARD),
    Rule(
        "sim drives the core, never the engine or the server",
        "pagekv.sim",
        forbidden=("pagekv.server", "pagekv.engine", "pagekv.llm", "pagekv.cli"),
    ),
    Rule(
        "sim imports torch, runner and models lazily (calibration only), never at module level",
        "pagekv.sim",
        forbidden=("torch", "pagekv.runner", "pagekv.models"),
        module_level_only=True,
    ),
    Rule(
        "trace (the engine writes it, the simulator reads it) needs only core's hash chain",
        "pagekv.core.trace",
        forbidden=("torch", "numpy"),
        only_pagekv=("pagekv.core", "pagekv.errors"),
        required=True,
    ),
    Rule("the engine never imports the simulator", "pagekv.engine", forbidden=("pagekv.sim",)),
    Rule(
        "the kernel build and target choice import no torch and nothing of pagekv but them",
        "pagekv.kernels.build",
        forbidden=("torch", "numpy"),
        only_pagekv=("pagekv.kernels.isa", "pagekv.errors"),
        required=True,
    ),
    Rule(
        "kernels import no runner, core or higher layer (models' LayerOps protocol only)",
        "pagekv.kernels",
        forbidden=("pagekv.runner", "pagekv.core", *UPWARD),
    ),
    Rule(
        "models import no runner, core or higher layer",
        "pagekv.models",
        forbidden=("pagekv.runner", "pagekv.core", *UPWARD),
    ),
)


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int
    module_level: bool  # runs when the file is imported (not in a def, not TYPE_CHECKING-only)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def find_imports(source: str, importer: str, is_package: bool = False) -> Iterator[Import]:
    """Every import in ``source``, resolved to absolute names (``from m import a`` gives m.a)."""

    def visit(node: ast.AST, runs: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            child_runs = runs and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, child.lineno, runs)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child.module, child.level, importer, is_package)
                for alias in child.names:
                    name = base if alias.name == "*" else f"{base}.{alias.name}"
                    yield Import(name, child.lineno, runs)
            elif isinstance(child, ast.Call) and child.args:
                func, arg = child.func, child.args[0]
                dynamic = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
                    isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
                )
                if dynamic and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield Import(arg.value, child.lineno, runs)
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from visit(ast.Module(body=child.body, type_ignores=[]), False)
                for orelse in child.orelse:
                    yield from visit(ast.Module(body=[orelse], type_ignores=[]), runs)
            else:
                yield from visit(child, child_runs)

    yield from visit(ast.parse(source), True)


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(rule: Rule, source: str, importer: str, is_package: bool = False) -> list[str]:
    """What in ``source`` breaks ``rule``, one ``line N: import X (why)`` string each."""
    out = []
    for imp in find_imports(source, importer, is_package):
        if rule.module_level_only and not imp.module_level:
            continue
        # ``from m import a`` is judged as ``m.a``: a prefix rule on m covers both readings.
        hit = next((p for p in rule.forbidden if _matches(imp.module, p)), None)
        if hit is not None:
            out.append(f"line {imp.line}: import {imp.module} (forbidden: {hit})")
        elif rule.only_pagekv is not None and _matches(imp.module, "pagekv"):
            allowed = (*rule.only_pagekv, rule.scope)
            if not any(_matches(imp.module, p) for p in allowed):
                out.append(f"line {imp.line}: import {imp.module} (not allowed from pagekv)")
    return out


def files_in(scope: str) -> list[Path]:
    path = REPO.joinpath(*scope.split("."))
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    module = path.with_suffix(".py")
    return [module] if module.is_file() else []


# Rules for layers that do not exist yet (tiering, server) join as soon as their folder does.
ACTIVE_RULES = [r for r in RULES if r.required or files_in(r.scope)]


@pytest.mark.parametrize("rule", ACTIVE_RULES, ids=[r.name for r in ACTIVE_RULES])
def test_layer_rule(rule: Rule) -> None:
    files = files_in(rule.scope)
    assert files, f"{rule.scope} is missing: the rule '{rule.name}' must always run"
    found = []
    for path in files:
        for v in violations(
            rule, path.read_text(), module_name(path), is_package=path.name == "__init__.py"
        ):
            found.append(f"{path.relative_to(REPO)}: {v}")
    assert not found, f"rule '{rule.name}' broken:\n" + "\n".join(found)


def test_every_pagekv_file_parses() -> None:
    for path in PACKAGE.rglob("*.py"):
        list(find_imports(path.read_text(), module_name(path)))


def modules_after(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules named by ``prefixes`` (a name or its submodules) that a fresh interpreter
    holds after ``import <imports>``, sorted."""
    code = (
        f"import sys, {imports}\n"
        f"prefixes = {prefixes!r}\n"
        "print(','.join(sorted(m for m in sys.modules\n"
        "    if any(m == p or m.startswith(p + '.') for p in prefixes))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [m for m in result.stdout.strip().split(",") if m]


def heavy_modules_after(imports: str) -> list[str]:
    """Which of torch/numpy a fresh interpreter holds after ``import <imports>``."""
    return [m for m in ("numpy", "torch") if m in modules_after(imports, ("numpy", "torch"))]


def test_import_core_does_not_load_torch() -> None:
    assert heavy_modules_after("pagekv.core, pagekv.core.invariants") == []


def test_the_subprocess_probe_sees_torch_when_it_is_loaded() -> None:
    assert "torch" in heavy_modules_after("pagekv.runner.kv_cache")


# ---- the checker itself can fail -------------------------------------------------------------

CORE = RULES[0]
TIERING_TORCH = next(r for r in RULES if r.module_level_only)
SERVER = next(r for r in RULES if r.scope == "pagekv.server")


def test_checker_flags_forbidden_imports_with_their_line() -> None:
    source = (
        "import os\n"
        "import torch.nn as nn\n"
        "from ..runner import kv_cache\n"
        "from pagekv import models\n"
        "from . import block_pool\n"
        "def f():\n"
        "    import numpy\n"
        "    return importlib.import_module('pagekv.server.app')\n"
    )
    got = violations(CORE, source, "pagekv.core.fake")
    assert got == [
        "line 2: import torch.nn (forbidden: torch)",
        "line 3: import pagekv.runner.kv_cache (forbidden: pagekv.runner)",
        "line 4: import pagekv.models (forbidden: pagekv.models)",
        "line 7: import numpy (forbidden: numpy)",
        "line 8: import pagekv.server.app (forbidden: pagekv.server)",
    ]


def test_checker_counts_type_checking_imports_for_everywhere_rules_only() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert violations(CORE, source, "pagekv.core.fake") == [
        "line 3: import torch (forbidden: torch)"
    ]
    assert violations(TIERING_TORCH, source, "pagekv.tiering.host_pool") == []
    lazy = "def load():\n    import torch\n    return torch\n"
    assert violations(TIERING_TORCH, lazy, "pagekv.tiering.host_pool") == []
    eager = "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
    assert violations(TIERING_TORCH, eager, "pagekv.tiering.host_pool") == [
        "line 2: import torch (forbidden: torch)"
    ]


def test_checker_allow_list_for_the_server() -> None:
    ok = (
        "from pagekv.engine import LLMEngine\n"
        "from pagekv import errors\n"
        "from pagekv.sampling_params import SamplingParams\n"
        "from .app import build\n"
        "import fastapi\n"
    )
    assert violations(SERVER, ok, "pagekv.server.routes") == []
    bad = "from pagekv.core.request import Request\nfrom pagekv import runner\n"
    assert violations(SERVER, bad, "pagekv.server.routes") == [
        "line 1: import pagekv.core.request.Request (not allowed from pagekv)",
        "line 2: import pagekv.runner (not allowed from pagekv)",
    ]


def test_relative_imports_resolve_from_packages_and_modules() -> None:
    assert _resolve("plan", 1, "pagekv.core.scheduler", False) == "pagekv.core.plan"
    assert _resolve("plan", 1, "pagekv.core", True) == "pagekv.core.plan"
    assert _resolve("runner", 2, "pagekv.core.scheduler", False) == "pagekv.runner"
    assert _resolve(None, 2, "pagekv.core.scheduler", False) == "pagekv"
