"""The documentation cannot drift from the code: every link resolves, every `facepipe` command line
in a code block parses with the CLI, every command the tables name has the options they show, every
`make` target, benchmark script, test and `section.key` parameter named in the docs exists.

What a command *does* is tested where the command is (test_cli.py, the stage tests); the demo and
the test commands of the Quick start are what CI runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from facepipe.cli import get_args_parser
from facepipe.config import SECTIONS

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", REPO / "tests" / "README.md", *(REPO / "docs").glob("*.md")])
IDS = [str(path.relative_to(REPO)) for path in DOCS]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, counts = set(), {}
    for line in strip_code(path.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.*)", line):
            base = slug(match.group(1))
            found.add(base if not counts.get(base) else f"{base}-{counts[base]}")
            counts[base] = counts.get(base, 0) + 1
    return found


def strip_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def code_lines(text: str) -> list[str]:
    """Lines of fenced code blocks, comments removed, continuation lines joined."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", strip_code(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def facepipe_commands(text: str) -> list[list[str]]:
    """The arguments of every facepipe command line in a code block."""
    commands = []
    for line in code_lines(text):
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part.replace("…", ""), comments=True)
            for start, word in enumerate(words):
                if word.split("/")[-1] == "facepipe" and (start == 0 or "=" in words[start - 1] or words[start - 1] == "time"):
                    commands.append(words[start + 1 :])
                    break
                if word == "-m" and start + 1 < len(words) and words[start + 1] == "facepipe":
                    commands.append(words[start + 2 :])
                    break
    return commands


def subcommands() -> dict:
    return next(a for a in get_args_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices


def options_of(command: str) -> set[str]:
    parser = subcommands()[command]
    known = {option for action in parser._actions for option in action.option_strings}
    for action in parser._actions:  # `weights fetch`
        if action.__class__.__name__ == "_SubParsersAction":
            known |= {o for sub in action.choices.values() for act in sub._actions for o in act.option_strings}
    return known


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_facepipe_command_in_a_code_block_parses(path: Path) -> None:
    parser = get_args_parser()
    bad = []
    for words in facepipe_commands(path.read_text()):
        try:
            parser.parse_args(words)
        except SystemExit:
            bad.append(shlex.join(words))
    assert not bad, bad


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_facepipe_command_named_in_the_text_exists_with_its_options(path: Path) -> None:
    """`facepipe prepare RAW OUT [--workers N]`, `facepipe prepare --update` …: usage patterns and
    fragments, so the command and each option it shows are checked, not a full parse."""
    bad = []
    for command, rest in re.findall(r"`facepipe ([a-z][a-z\-]*)([^`]*)`", strip_code(path.read_text())):
        if command not in subcommands():
            bad.append(command)
        elif missing := set(re.findall(r"(?<![\w-])--[a-z][a-z\-]*", rest)) - options_of(command):
            bad.append(f"{command} {sorted(missing)}")
    assert not bad, bad


def test_the_pipeline_table_names_every_command() -> None:
    table = (REPO / "README.md").read_text().split("## The pipeline")[1].split("\n## ")[0]
    shown = set(re.findall(r"^\| [a-z\-]+ \| `facepipe ([a-z\-]+)", table, flags=re.M))
    assert shown == set(subcommands())


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_make_targets_benchmark_scripts_and_tests_named_exist(path: Path) -> None:
    text = path.read_text()
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z\-]*):", makefile, flags=re.M))
    named = {t for line in code_lines(text) for t in re.findall(r"(?:^|&& )make ([a-z][a-z\-]*)", line)}
    named |= set(re.findall(r"`make ([a-z][a-z\-]*)", text))
    assert named <= targets, sorted(named - targets)
    scripts = set(re.findall(r"benchmarks/([a-z_]+\.py)", text))
    assert all((REPO / "benchmarks" / s).is_file() for s in scripts), sorted(s for s in scripts if not (REPO / "benchmarks" / s).is_file())
    missing = []
    for file, name in re.findall(r"(test_[a-z0-9_]+\.py)(?:::(test_[A-Za-z0-9_]+))?", text):
        test_file = REPO / "tests" / file
        if not test_file.is_file():
            missing.append(file)
        elif name and not re.search(rf"def {re.escape(name)}\b", test_file.read_text()):
            missing.append(f"{file}::{name}")
    assert not missing, missing


FILE_SUFFIXES = {"json", "jsonl", "rec", "idx", "lst", "yaml", "txt", "csv", "png", "py", "bin", "pt", "onnx", "lmdb", "html", "lock"}


def is_code(section: str, name: str) -> bool:
    """``prepare.process_chunks``: a function of the stage module (or its flow), not a parameter."""
    import importlib

    for module in (f"facepipe.stages.{section}", f"flows.{section}"):
        try:
            if hasattr(importlib.import_module(module), name):
                return True
        except ImportError:
            pass
    return False


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_every_section_key_named_is_a_parameter(path: Path) -> None:
    unknown = set()
    for section, key in re.findall(rf"`({'|'.join(SECTIONS)})\.([a-z_]+)(?=[`:= ])", path.read_text()):
        if key not in SECTIONS[section].model_fields and key not in FILE_SUFFIXES and not is_code(section, key):
            unknown.add(f"{section}.{key}")
    assert not unknown, sorted(unknown)
