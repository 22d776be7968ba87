"""``facepipe`` itself: the command table, every sub-command's arguments, exit codes, and the layering
(the CLI imports the stages, never the other way round)."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from facepipe.cli import get_args_parser, main

ROOT = Path(__file__).resolve().parents[1]

#: Every sub-command's arguments as released: (name, metavar, default, type, choices). A script that
#: works today must keep working: commands and options may be added, none of these may change.
STABLE: dict[str, list[tuple]] = {
    "sample-data": [("out", "OUT", None, "Path", None), ("--params", "FILE", None, None, None),
                    ("--identities", "N", None, "int", None), ("--images-per-identity", "N", None, "int", None),
                    ("--seed", "N", None, "int", None)],
    "prepare": [("raw", "RAW", None, "Path", None), ("out", "OUT", None, "Path", None),
                ("--params", "FILE", None, None, None), ("--workers", "N", None, "int", None),
                ("--scheduler-address", "ADDR", None, None, None), ("--device", None, "auto", None, None)],
    "import": [("source", "SOURCE", None, "Path", None), ("out", "OUT", None, "Path", None),
               ("--params", "FILE", None, None, None), ("--workers", "N", None, "int", None)],
    "inspect": [("root", "PREPARED", None, "Path", None), ("--dump", "DIR", None, "Path", None),
                ("--limit", "N", None, "int", None), ("--json", None, False, None, None),
                ("--html", "FILE", None, "Path", None), ("--raw", "RAW", None, "Path", None)],
    "verify": [("root", "PREPARED", None, "Path", None)],
    "split": [("prepared", "PREPARED", None, "Path", None), ("out", "OUT", None, "Path", None),
              ("--params", "FILE", None, None, None)],
    "train": [("prepared", "PREPARED", None, "Path", None), ("out", "OUT", None, "Path", None),
              ("--params", "FILE", None, None, None), ("--identities", "FILE", None, "Path", None),
              ("--max-steps", "N", None, "int", None), ("--fresh", None, False, None, None)],
    "evaluate": [("model", "MODEL", None, "Path", None), ("prepared", "PREPARED", None, "Path", None),
                 ("out", "OUT", None, "Path", None), ("--pairs", "FILE", None, "Path", None),
                 ("--params", "FILE", None, None, None)],
    "export": [("model", "MODEL", None, "Path", None), ("out", "OUT", None, "Path", None),
               ("--params", "FILE", None, None, None)],
    "export-rec": [("prepared", "PREPARED", None, "Path", None), ("out", "OUT", None, "Path", None)],
    "weights fetch": [("name", None, None, None, ("retinaface",)), ("--cache", "DIR", None, None, None),
                      ("--index-url", "URL", None, None, None)],
}


def argument_rows(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[str, list[tuple]]:
    """``{"command [action]": [(name, metavar, default, type, choices), ...]}`` of every sub-command."""
    rows: dict[str, list[tuple]] = {}
    if prefix:
        rows[" ".join(prefix)] = [
            ("/".join(a.option_strings) or a.dest, a.metavar, a.default, getattr(a.type, "__name__", None),
             tuple(a.choices) if a.choices else None)
            for a in parser._actions  # noqa: SLF001 - argparse keeps them here
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))  # noqa: SLF001
        ]
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                rows.update(argument_rows(sub, (*prefix, name)))
    return rows


def test_every_released_argument_is_still_there_unchanged():
    rows = argument_rows(get_args_parser())
    for command, expected in STABLE.items():
        assert command in rows, command
        missing = [row for row in expected if row not in rows[command]]
        assert not missing, f"facepipe {command}: changed or gone: {missing}"
        positionals = [row[0] for row in rows[command] if not row[0].startswith("-")]
        assert positionals == [row[0] for row in expected if not row[0].startswith("-")], command


def test_help_lists_the_commands_in_the_released_order(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    positions = [text.index(f"    {name.split()[0]} ") for name in STABLE if name != "weights fetch"]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prepare", "{tmp}/missing", "{tmp}/out"], "facepipe prepare: error: raw folder not found"),
        (["prepare", "{tmp}", "{tmp}/out", "--workers", "0"], "facepipe prepare: error: --workers must be >= 1"),
        (["import", "{tmp}", "{tmp}/out", "--workers", "0"], "facepipe import: error: --workers must be >= 1"),
        (["train", "{tmp}", "{tmp}/out", "--max-steps", "0"], "facepipe train: error: --max-steps must be >= 1"),
        (["split", "{tmp}", "{tmp}/out", "--params", "{tmp}/none.yaml"], "facepipe split: error: "),
        (["inspect", "{tmp}", "--html", "{tmp}/r.html", "--raw", "{tmp}/missing"], "facepipe inspect: error: raw folder not found"),
        (["inspect", "{tmp}", "--dump", "{tmp}/d", "--limit", "-1"], "facepipe inspect: error: --limit must be >= 0"),
        (["weights", "fetch", "retinaface", "--cache", "{tmp}/cache-file"], "facepipe weights: error: the weights cache {tmp}/cache-file is not a folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "cache-file").write_text("")  # a file where a folder is expected (the weights cache)
    assert main([word.format(tmp=tmp_path) for word in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err


def test_usage_errors_exit_2(capsys):
    for argv in (["prepare"], ["no-such-command"], ["train", "a", "b", "--max-steps", "x"], ["weights", "fetch", "x"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
    assert "usage: facepipe" in capsys.readouterr().err


def test_interrupt_exits_130(tmp_path, capsys, monkeypatch):
    from facepipe.stages import split

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(split, "run", interrupted)
    (tmp_path / "params.yaml").write_text("split: {}\n")
    assert main(["split", str(tmp_path), str(tmp_path / "out"), "--params", str(tmp_path / "params.yaml")]) == 130
    assert capsys.readouterr().err.endswith("facepipe split: interrupted\n")


def test_a_command_runs_and_exits_0(tmp_path, capsys):
    argv = ["sample-data", str(tmp_path / "raw"), "--identities", "2", "--images-per-identity", "1", "--seed", "3",
            "--params", str(tmp_path / "none.yaml")]
    assert main(argv) == 2  # a named params file must exist
    assert main(argv[:-2]) == 0
    assert "sample-data: wrote" in capsys.readouterr().out
    assert len([p for p in (tmp_path / "raw").rglob("*") if p.is_file()]) >= 2


def test_python_dash_m_facepipe_is_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "facepipe", "--help"], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "100"}, timeout=120)
    assert result.returncode == 0 and "export-rec" in result.stdout, result.stderr


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_stages_do_not_import_the_cli_or_parse_arguments():
    """Imports point down (docs/architecture.md, "Layers"): the command table in facepipe/cli.py owns parsing."""
    for path in sorted((ROOT / "facepipe" / "stages").glob("*.py")):
        names = _imports(path)
        assert "facepipe.cli" not in names, f"{path.name} imports facepipe.cli"
        assert "argparse" not in names, f"{path.name} parses arguments"


def test_the_prepare_flow_calls_the_stage_api_not_the_core():
    names = _imports(ROOT / "flows" / "prepare.py")
    assert not {name for name in names if name.startswith("facepipe.data")}, names
