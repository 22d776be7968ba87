"""What `dvc repro` prints for prepare: facepipe's own progress and summary, not Dask's and Prefect's
INFO chatter (hundreds of lines on a big set: every worker's start and stop, every chunk task)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from facepipe.cli import get_args_parser
from rawdata import TEST_PARAMS, make_faces_raw

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_INFO = re.compile(r"\|\s*INFO\s*\|\s*(distributed\.|prefect\.|Task run )|INFO distributed\.|INFO prefect")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_prepare_flow_prints_no_library_info_lines(tmp_path):
    """The command `dvc repro` runs for prepare (the Prefect flow on 2 Dask workers, with its
    temporary server): no `distributed.` / Prefect INFO line, but the summary."""
    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": TEST_PARAMS}))
    result = subprocess.run(
        [sys.executable, "-m", "flows.prepare", str(raw), str(tmp_path / "out"), "--params", str(params), "--workers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    noisy = [line for line in result.stderr.splitlines() if LIBRARY_INFO.search(line)]
    assert noisy == [], "\n".join(noisy[:20])
    assert "prepare: scanned 17, accepted 7, rejected 10" in result.stdout + result.stderr
    assert len(result.stderr.splitlines()) < 15, result.stderr


def test_every_command_takes_verbose():
    parser = get_args_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    for name, sub in commands.items():
        if name == "weights":
            continue
        assert any("--verbose" in action.option_strings for action in sub._actions), name
    assert parser.parse_args(["prepare", "a", "b", "--verbose"]).verbose is True
    assert parser.parse_args(["-v", "prepare", "a", "b"]).verbose is True
    assert parser.parse_args(["prepare", "a", "b"]).verbose is False


def test_flow_console_keeps_facepipe_lines_and_drops_library_info():
    from flows.logs import console_filter

    quiet = console_filter(verbose=False)
    record = lambda name, level: logging.LogRecord(name, level, __file__, 1, "m", None, None)  # noqa: E731
    assert not quiet.filter(record("distributed.worker", logging.INFO))
    assert not quiet.filter(record("prefect.task_runs", logging.INFO))
    assert quiet.filter(record("distributed.nanny", logging.WARNING))
    assert quiet.filter(record("facepipe.prepare", logging.INFO))
    assert console_filter(verbose=True).filter(record("distributed.worker", logging.INFO))
