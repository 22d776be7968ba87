"""dvc.yaml: every stage's deps cover the facepipe and flows code its command runs.

The import closure of each stage's entry module is derived from the source (every ``import`` and
``from … import`` statement, at module level or inside functions, followed through facepipe/ and
flows/), so a module added tomorrow is checked without touching this test. A listed folder covers
every file below it.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("facepipe", "flows")

# Code that every command passes through but that cannot change what a stage writes: the argparse
# dispatcher (it imports every stage module only to register its sub-command), the exception types,
# the progress display and the offline environment defaults. Listing them would rerun every stage
# after any edit to a help text.
NEUTRAL = {
    "facepipe/__init__.py",
    "facepipe/__main__.py",
    "facepipe/cli.py",
    "facepipe/errors.py",
    "facepipe/offline.py",
    "facepipe/progress.py",
    "facepipe/stages/__init__.py",
    "flows/__init__.py",
}


def module_file(name: str) -> Path | None:
    """The source file of module ``name`` if it is one of ours (package ``__init__.py`` or module)."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere, with the packages their import executes."""
    names: set[str] = set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # submodules among the names
    with_parents = set()
    for name in names:
        parts = name.split(".")
        with_parents.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    return with_parents


def import_closure(entry: str) -> set[str]:
    """Repository-relative paths of our source files that running module ``entry`` may execute."""
    start = module_file(entry)
    assert start is not None, entry
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        relative = path.relative_to(ROOT).as_posix()
        if relative in NEUTRAL and path != start:
            continue  # not followed: the dispatcher would pull in every stage
        todo.extend(f for name in imported_modules(path) if (f := module_file(name)) is not None)
    return {path.relative_to(ROOT).as_posix() for path in seen}


def entry_module(cmd: str) -> str:
    """The module a stage command runs: ``python -m flows.X`` -> flows.X; ``… -m facepipe STAGE``
    -> facepipe.stages.STAGE (what the CLI dispatches to)."""
    words = shlex.split(cmd)
    module = words[words.index("-m") + 1]
    if module == "facepipe":
        stage = words[words.index("-m") + 2].replace("-", "_")
        return f"facepipe.stages.{stage}"
    return module


def dvc_stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def covered(path: str, deps: list[str]) -> bool:
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def docstring_only(path: str) -> bool:
    """A file with nothing but a docstring (a package marker) runs no code."""
    body = ast.parse((ROOT / path).read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


@pytest.mark.parametrize("stage", sorted(dvc_stages()))
def test_stage_deps_cover_the_code_its_command_imports(stage: str) -> None:
    spec = dvc_stages()[stage]
    entry = entry_module(spec["cmd"])
    needed = {path for path in import_closure(entry) - NEUTRAL if not docstring_only(path)}
    missing = sorted(path for path in needed if not covered(path, spec["deps"]))
    assert not missing, f"dvc.yaml stage {stage!r} ({entry}) runs code not in its deps: {missing}"


def test_the_walker_finds_what_it_must() -> None:
    """The closure of the export stage holds what its imports name, directly and through a package."""
    closure = import_closure("facepipe.stages.export")
    assert {"facepipe/model_export.py", "facepipe/io/model_dir.py", "facepipe/io/atomic.py"} <= closure
    assert "facepipe/io/__init__.py" in closure  # executed by any `from facepipe.io.x import …`
    assert "facepipe/stages/train.py" not in closure  # the dispatcher is not followed
    assert entry_module("torchrun --standalone --nproc-per-node 2 -m facepipe train a b") == "facepipe.stages.train"
    assert entry_module("python -m flows.prepare data/raw data/prepared") == "flows.prepare"


@pytest.mark.slow
def test_the_walker_sees_everything_an_import_loads() -> None:
    """Cross-check of the static walk: importing each entry module for real, in a fresh interpreter,
    loads none of our files outside its closure."""
    entries = sorted({entry_module(spec["cmd"]) for spec in dvc_stages().values()})
    script = (
        "import importlib, sys, pathlib\n"
        "importlib.import_module(sys.argv[1])\n"
        "root = pathlib.Path(sys.argv[2])\n"
        "for m in list(sys.modules.values()):\n"
        "    f = getattr(m, '__file__', None)\n"
        "    if f and pathlib.Path(f).resolve().is_relative_to(root):\n"
        "        print(pathlib.Path(f).resolve().relative_to(root).as_posix())\n"
    )
    for entry in entries:
        loaded = subprocess.run(
            [sys.executable, "-c", script, entry, str(ROOT)], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        ours = {path for path in loaded if path.split("/")[0] in PACKAGES}
        assert ours - import_closure(entry) - NEUTRAL == set(), entry
