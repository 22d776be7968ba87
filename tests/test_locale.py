"""The locale does not change what facepipe writes: a machine whose locale encodes text as ASCII (or
Latin-1) writes the same bytes for photos with non-ASCII names as a UTF-8 one, and does not crash.

Python opens text files in the locale's encoding unless told otherwise; under the C locale with
locale coercion and UTF-8 mode switched off that encoding is ASCII, which is what a server with
``LANG`` unset or ``LANG=C`` and an older Python (or ``PYTHONUTF8=0``) gives.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from test_update import face, files_of, write

pytestmark = pytest.mark.multiprocess  # two CLI runs in fresh interpreters

NAMES = {
    "José Martínez/0001.jpg": face(1),
    "José Martínez/0002.jpg": face(2),
    "王小明/0001.jpg": face(3),
    "王小明/0002.jpg": face(4),
    "Zoë/0001.jpg": face(5),
    "Zoë/ñot-a-photo.jpg": b"not an image at all",
}


def facepipe_under(env_update: dict[str, str], *args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8", "PYTHONIOENCODING"))}
    env.update(env_update)
    cmd = [sys.executable, "-m", "facepipe", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, encoding="utf-8", errors="replace")


def test_an_ascii_locale_writes_the_bytes_a_utf8_one_does(tmp_path):
    raw = tmp_path / "raw"
    write(raw, NAMES)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": {"detector": "none", "samples_per_shard": 3, "chunk_size": 4}, "split": {"val_identities": 2, "num_pairs": 4}}))
    probe = "import locale; print(locale.getpreferredencoding(False))"
    ascii_env = {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    encoding = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **ascii_env}, capture_output=True, text=True
    ).stdout.strip()
    assert encoding in ("ANSI_X3.4-1968", "ascii", "US-ASCII"), f"the ASCII locale is not ASCII here: {encoding}"

    utf8_env = {"LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    for name, env in (("utf8", utf8_env), ("ascii", ascii_env)):
        for args in (
            ("prepare", raw, tmp_path / name, "--params", params, "--workers", "1"),
            ("verify", tmp_path / name),
            ("inspect", tmp_path / name),
            ("split", tmp_path / name, tmp_path / f"{name}-split", "--params", params),
        ):
            run = facepipe_under(env, *args)
            assert run.returncode == 0, (name, args[0], run.stderr[-2000:])
    assert files_of(tmp_path / "ascii-split") == files_of(tmp_path / "utf8-split")

    written = files_of(tmp_path / "utf8")
    assert "José Martínez".encode() in written["sources.jsonl"] and "ñot-a-photo".encode() in written["rejects.jsonl"]
    other = files_of(tmp_path / "ascii")
    timings = {"report.json", "report.html"}  # the run's timings; both runs read the same files (same mtimes)
    assert sorted(other) == sorted(written)
    for name in sorted(set(written) - timings):
        assert other[name] == written[name], name
