"""Each shared name has one home (issue 9, "While there (structure)").

The choice lists of params.yaml live in ``facepipe.config`` (the bottom layer) and the code that acts on
them imports them; the backbone and head names there are the registries' names; ``Registry`` lives in a
neutral module that both registries borrow.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Literal, get_args, get_origin

import facepipe
from facepipe import config
from facepipe.detection.registry import DETECTORS, list_detectors
from facepipe.heads import list_heads
from facepipe.heads.registry import HEADS
from facepipe.models import list_backbones
from facepipe.models.registry import BACKBONES
from facepipe.registry import Registry

PACKAGE = Path(facepipe.__file__).resolve().parent
#: config's choice lists: name -> values
CHOICES = {name: frozenset(get_args(value)) for name, value in vars(config).items() if get_origin(value) is Literal}


def test_config_names_are_the_registries_names() -> None:
    """A new backbone or head: register it and add its name to config's list; this says which is missing."""
    assert sorted(get_args(config.BackboneName)) == list_backbones(), "config.BackboneName != registered backbones"
    assert sorted(get_args(config.HeadName)) == list_heads(), "config.HeadName != registered heads"
    assert sorted(get_args(config.DetectorName)) == list_detectors(), "config.DetectorName != registered detectors"
    fields = config.TrainParams.model_fields
    assert fields["backbone"].annotation is config.BackboneName and fields["head"].annotation is config.HeadName
    assert config.PrepareParams.model_fields["detector"].annotation is config.DetectorName


def _literals(path: Path) -> list[tuple[int, frozenset[object]]]:
    """Every ``Literal[...]`` written in ``path``, and every tuple, list or set of two or more strings
    (a choice list spelled as data, like the detector names once were): (line, its values)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal":
            elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            found.append((node.lineno, frozenset(ast.literal_eval(e) for e in elements)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
        ):
            found.append((node.lineno, frozenset(e.value for e in node.elts)))
    return found


def test_each_choice_list_is_written_once() -> None:
    assert {"CommHook", "Precision", "LRScaling", "Decay", "OptimizerName", "HeadParallel"} <= CHOICES.keys()
    assert len(set(CHOICES.values())) == len(CHOICES), "two of config's choice lists are the same"
    checked = {values: name for name, values in CHOICES.items()}
    copies = [
        f"{path.relative_to(PACKAGE.parent)}:{line} repeats config.{checked[values]}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "config.py"
        for line, values in _literals(path)
        if values in checked
    ]
    assert not copies, "import the list from facepipe.config instead: " + "; ".join(copies)


def test_the_code_uses_configs_lists() -> None:
    from facepipe import model_export
    from facepipe.training import distributed, optimizer, schedule, trainer

    assert distributed.CommHook is config.CommHook
    assert trainer.Precision is config.Precision
    assert optimizer.OptimizerName is config.OptimizerName
    assert (schedule.LRScaling, schedule.Decay) == (config.LRScaling, config.Decay)
    assert model_export.ExportFormat is config.ExportFormat


def test_every_registry_is_the_one_mechanism() -> None:
    """Whatever is chosen by name (backbones, heads, detectors) is filed in a ``facepipe.registry.Registry``
    by a decorator: every registry module holds one, and none picks by comparing names."""
    assert all(isinstance(registry, Registry) for registry in (BACKBONES, HEADS, DETECTORS))
    for path in sorted(PACKAGE.rglob("registry.py")):
        if path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "Registry" in calls, f"{path.relative_to(PACKAGE.parent)} builds no Registry"
        chains = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.Eq)]
        assert not chains, f"{path.relative_to(PACKAGE.parent)}: an if-chain on names at lines {chains}"


def test_no_caller_compares_the_detector_by_name() -> None:
    """Callers ask the detector's traits (``PrepareParams.needs_alignment``, ``detector_kind(name)``)."""
    offences = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "flows").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                getattr(side, "attr", None) == "detector" for side in (node.left, *node.comparators)
            ):
                offences.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "detector" for k in node.keys):
                values = [v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == "detector"]
                offences += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} (a detector by name)" for v in values if isinstance(v, ast.Constant)]
    assert not offences, "; ".join(offences)


def test_registry_lives_outside_the_layers_that_use_it() -> None:
    assert isinstance(BACKBONES, Registry) and isinstance(HEADS, Registry)
    assert Registry.__module__ == "facepipe.registry"
    for path in (PACKAGE / "heads").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imported if m.startswith("facepipe.models")], f"{path.name} borrows from models"


# --- rooms and arrows (issue 20) ------------------------------------------------------------------
ROOT = PACKAGE.parent
#: The code that may name, link or rename shard files: io/ (formats) and the shard-set room.
SHARD_ROOMS = ("facepipe/io/", "facepipe/shardset/")
#: The core never imports these (docs/architecture.md, "Layers").
ABOVE_THE_CORE = ("facepipe.stages", "facepipe.cli", "flows", "prefect", "dvc")


def _above_the_core(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in ABOVE_THE_CORE)
CORE = ("alignment", "data", "detection", "io", "models", "heads", "training", "evaluation", "quality", "shardset", "gallery")


def _sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "flows").rglob("*.py")])


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _shard_file_handling(tree: ast.AST) -> list[tuple[int, str]]:
    """Where ``tree`` spells a shard file name, joins a path with ``"shards"``, or links or renames a file."""
    found = []
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ("shard-" in node.value or ".lmdb" in node.value):
            found.append((node.lineno, f"the shard file name {node.value!r}"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and any(
            isinstance(side, ast.Constant) and side.value == "shards" for side in (node.left, node.right)
        ):
            found.append((node.lineno, 'a path joined with "shards"'))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("link", "hardlink_to", "rename"):
            found.append((node.lineno, f".{node.func.attr}()"))
    return found


def test_no_shard_file_is_named_linked_or_renamed_outside_io_and_the_shard_set_room() -> None:
    """Shard paths come from ``facepipe.io.shards`` (``shard_path``, ``shard_name``, ``SHARD_PATTERN``);
    generations link and rename shards in ``facepipe.shardset.builder`` only."""
    offences = [
        f"{_name(path)}:{line}: {what}"
        for path in _sources()
        if not _name(path).startswith(SHARD_ROOMS)
        for line, what in _shard_file_handling(ast.parse(path.read_text(), str(path)))
    ]
    assert not offences, "; ".join(offences)


def _module_imports(path: Path) -> set[str]:
    """The modules ``path`` imports at module level (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, inside functions too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_core_and_the_shard_set_room_import_nothing_above_them() -> None:
    offences = [
        f"{_name(path)} imports {module}"
        for room in CORE
        for path in sorted((PACKAGE / room).rglob("*.py") if (PACKAGE / room).is_dir() else [PACKAGE / f"{room}.py"])
        for module in sorted(_all_imports(path))
        if _above_the_core(module)
    ]
    offences += [
        f"{_name(path)} imports {module}"
        for path in sorted((PACKAGE / "io").rglob("*.py"))
        for module in sorted(_all_imports(path))
        if module.startswith("facepipe.shardset")
    ]
    assert not offences, "; ".join(offences)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_module_level_imports_have_no_cycle() -> None:
    """Arrows point down: no module of facepipe/ or flows/ imports itself back at load time."""
    modules = {_module_of(path): path for path in _sources()}

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def below(name: str, target: str) -> bool:  # a package's own modules import from it while it loads
        return name.startswith(target + ".")

    graph = {
        name: {m for m in map(ours, _module_imports(path)) if m and m != name and not below(name, m)}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "; ".join(cycles)


#: Lines a function of facepipe/ or flows/ may take, docstring included (a screen).
FUNCTION_LINES = 60
#: Functions allowed past the ceiling, each with why: keep this list short and shrinking.
LONG_FUNCTIONS: dict[str, str] = {}


def test_every_function_fits_on_a_screen() -> None:
    long = {
        f"{_name(path)}::{node.name}": node.end_lineno - node.lineno + 1
        for path in _sources()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    }
    unexplained = {name: lines for name, lines in long.items() if name not in LONG_FUNCTIONS}
    assert not unexplained, f"split these (over {FUNCTION_LINES} lines): {unexplained}"
    assert not LONG_FUNCTIONS.keys() - long.keys(), "LONG_FUNCTIONS lists a function that fits now: remove it"


def test_one_file_hash_and_one_jsonl_reader() -> None:
    """Files are hashed by ``facepipe.io.shards.sha256_file`` and JSONL files read by
    ``facepipe.io.manifest.read_jsonl``: no other function both starts a sha256 and reads a file, or
    parses lines of an open file as JSON."""
    homes = {"facepipe/io/shards.py::sha256_file", "facepipe/io/manifest.py::read_jsonl"}
    copies = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or f"{_name(path)}::{node.name}" in homes:
                continue
            calls = [n.func for n in ast.walk(node) if isinstance(n, ast.Call)]
            attrs = {f.attr for f in calls if isinstance(f, ast.Attribute)}
            hashes = any(isinstance(f, ast.Attribute) and f.attr == "sha256" and getattr(f.value, "id", "") == "hashlib" for f in calls)
            opens = "open" in attrs or any(isinstance(f, ast.Name) and f.id == "open" for f in calls)
            if hashes and opens and "read" in attrs:
                copies.append(f"{_name(path)}::{node.name} hashes a file")
            loops = [n for n in ast.walk(node) if isinstance(n, ast.For) and isinstance(n.iter, ast.Name)]
            if opens and "loads" in attrs and loops:
                copies.append(f"{_name(path)}::{node.name} reads JSON lines")
    assert not copies, "; ".join(copies)


def _text_io_without_encoding(tree: ast.AST) -> list[int]:
    """Lines that open, read or write a file as text without naming the encoding: the locale's
    would be used (ASCII on a server with LANG unset), so the bytes would follow the machine."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("read_text", "write_text"):
            lines.append(node.lineno)
        elif isinstance(func, ast.Name) and func.id == "open" or isinstance(func, ast.Attribute) and func.attr == "open" and (
            isinstance(func.value, ast.Name) and func.value.id in ("io", "builtins")
        ):
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                lines.append(node.lineno)
    return lines


def test_every_text_file_is_read_and_written_as_utf8() -> None:
    found = [f"{_name(path)}:{line}" for path in _sources() for line in _text_io_without_encoding(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, found
