"""Imports point down the stack: the packages below never import `benchmarks` or `tests`, which
sit above them (an installed package has neither)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hybrid_runtime", "predictor", "forecast", "cpu_kernels", "gpu_kernels")
ABOVE = ("benchmarks", "tests")


def _upward_imports(path: Path) -> list[str]:
    """`file:line module` for every import of a module above the packages, wherever it sits in the
    file (module level or inside a function), and every `import_module("benchmarks...")`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ABOVE]
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_module_imports_benchmarks_or_tests(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    assert [hit for f in files for hit in _upward_imports(f)] == []


def test_the_scan_finds_a_function_local_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    demo = tmp_path / "demo.py"
    demo.write_text("def f():\n    from benchmarks.common import write_results\n    import tests.helpers\n"
                    "    importlib.import_module('benchmarks.sparda')\n")
    assert _upward_imports(demo) == ["demo.py:2 benchmarks.common", "demo.py:3 tests.helpers",
                                     "demo.py:4 benchmarks.sparda"]


def test_experiments_import_and_write_results_without_benchmarks(tmp_path):
    """Every experiments module imports, and the results contract writes its file, in a process
    where `benchmarks` and `tests` cannot be imported (as for an installed package)."""
    import hybrid_runtime.experiments as experiments

    modules = [f"hybrid_runtime.experiments.{m.name}" for m in pkgutil.iter_modules(experiments.__path__)]
    script = f"""
import importlib, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABOVE!r}:
            raise ImportError(f"{{name}} sits above the package")
sys.meta_path.insert(0, Refuse())
for m in {modules!r}:
    importlib.import_module(m)
from hybrid_runtime.profiling.results import device_kind_slug, write_results
path = write_results("layering", {{"n": 1}}, [], out_path={str(tmp_path)!r} + f"/layering-{{device_kind_slug()}}.json")
print(path)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip().splitlines()[-1]).is_file()


def _imports(path: Path, module_level_only: bool) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`; with `module_level_only`, only those
    executed at import time (not inside a function or class body)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # also imports under a module-level `try` or `if`
        nodes = [n for top in tree.body for n in ast.walk(top)
                 if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_only_cli_and_experiments_import_cli_or_experiments():
    """Nothing else in the package reaches up to the CLI or the experiments, even inside a function."""
    hits = []
    for f in sorted((ROOT / "hybrid_runtime").rglob("*.py")):
        rel = f.relative_to(ROOT / "hybrid_runtime")
        if rel.parts[0] == "experiments" or rel.name == "cli.py":
            continue
        hits += [f"{f.relative_to(ROOT)}:{line} {m}" for line, m in _imports(f, module_level_only=False)
                 if m.startswith(("hybrid_runtime.cli", "hybrid_runtime.experiments"))]
    assert hits == []


def test_the_model_code_the_runtime_imports_does_not_import_the_runtime():
    """`predictor/` and `forecast/` modules that `hybrid_runtime` imports at module level (the decode
    path's model code) import nothing of `hybrid_runtime` when they load, directly or through each
    other: their offline commands may reach back into the package only inside functions."""
    wanted = set()
    for f in sorted((ROOT / "hybrid_runtime").rglob("*.py")):
        wanted |= {m for _, m in _imports(f, module_level_only=True) if m.split(".")[0] in ("predictor", "forecast")}
    assert wanted, "hybrid_runtime imports no predictor or forecast module at module level any more"
    seen, hits = set(), []
    while wanted:
        name = wanted.pop()
        path = ROOT / (name.replace(".", "/") + ".py")
        if name in seen or not path.is_file():
            seen.add(name)
            continue
        seen.add(name)
        for line, m in _imports(path, module_level_only=True):
            if m.split(".")[0] == "hybrid_runtime":
                hits.append(f"{path.relative_to(ROOT)}:{line} {m}")
            elif m.split(".")[0] in ("predictor", "forecast"):
                wanted.add(m)
    assert hits == []
