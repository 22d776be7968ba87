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
    fields = config.TrainParams.model_fields
    assert fields["backbone"].annotation is config.BackboneName and fields["head"].annotation is config.HeadName


def _literals(path: Path) -> list[tuple[int, frozenset[object]]]:
    """Every ``Literal[...]`` written in ``path``: (line, its values)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal":
            elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            found.append((node.lineno, frozenset(ast.literal_eval(e) for e in elements)))
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
    from facepipe import exporting
    from facepipe.training import distributed, optimizer, schedule, trainer

    assert distributed.CommHook is config.CommHook
    assert trainer.Precision is config.Precision
    assert optimizer.OptimizerName is config.OptimizerName
    assert (schedule.LRScaling, schedule.Decay) == (config.LRScaling, config.Decay)
    assert exporting.ExportFormat is config.ExportFormat


def test_registry_lives_outside_the_layers_that_use_it() -> None:
    assert isinstance(BACKBONES, Registry) and isinstance(HEADS, Registry)
    assert Registry.__module__ == "facepipe.registry"
    for path in (PACKAGE / "heads").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imported if m.startswith("facepipe.models")], f"{path.name} borrows from models"
