"""``benchmarks/prepare_profile.py --timers`` (the phase table of a worker's CPU time, per photo),
``benchmarks/detector_network.py`` (the network's runtimes side by side), and the benchmark scripts'
refusals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rawdata import astronaut, hopper, save, variant

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_timers_account_for_every_phase_of_a_retinaface_worker(tmp_path, retinaface_onnx):
    raw = tmp_path / "raw"
    for index in range(20):  # 16 untimed (the first chunk), 4 timed
        face = (hopper, astronaut)[index % 2]()
        save(variant(face, angle=index - 10, scale=2.0), raw / f"id{index % 4}" / f"{index:02}.jpg", quality=90)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prepare_profile.py"), str(raw), "--photos", "4", "--timers"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    total = float(re.search(r"4 photos, ([\d.]+) ms CPU per photo \(no profiler\)", run.stdout).group(1))
    rows = dict(re.findall(r"^\| ([^|]+) \| ([\d.-]+) \| \d+% \|$", run.stdout, re.MULTILINE))
    assert set(rows) >= {"detector network (onnxruntime)", "JPEG decode (libjpeg-turbo)", "header parsing", "the rest"}
    assert float(rows["detector network (onnxruntime)"]) > 0 and float(rows["JPEG decode (libjpeg-turbo)"]) > 0
    assert sum(map(float, rows.values())) == pytest.approx(total, abs=0.01 * len(rows))  # the rest closes the sum


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("prepare_profile.py", ["{missing}", "--timers"], "cannot read the raw folder"),
        ("prepare_profile.py", ["{empty}"], "no photo to profile"),
        ("large_set.py", ["{missing}", "{out}"], "no sample photos"),
        ("large_set.py", ["{empty}", "{out}"], "no sample photos"),
        ("detector_network.py", ["{missing}"], "cannot read the raw folder"),
        ("detector_network.py", ["{empty}"], "has 0 photos; 20 timed + 16 to calibrate int8 needed"),
    ],
)
def test_a_benchmark_script_given_no_photos_says_so_in_one_line(tmp_path, script, args, named):
    (tmp_path / "empty").mkdir()
    where = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "out": tmp_path / "out"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *(a.format(**where) for a in args)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and named in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.slow
def test_the_network_table_times_onnxruntime_against_itself_at_zero_difference_and_int8_beside_it(tmp_path, retinaface_onnx):
    raw = tmp_path / "raw"
    for index in range(4):
        face = (hopper, astronaut)[index % 2]()
        save(variant(face, angle=index, scale=2.0), raw / f"id{index % 2}" / f"{index:02}.jpg", quality=90)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "detector_network.py"), str(raw), "--photos", "2", "--calibration", "2", "--repeats", "1"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    rows = {row[0]: row[1:] for row in re.findall(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+)x \| (.+) \|$", run.stdout, re.MULTILINE)}
    assert {"onnxruntime", "int8"} <= set(rows), run.stdout
    assert rows["onnxruntime"][1:] == ("1.00", "0, 0, 0")  # the reference against itself
    assert float(rows["int8"][0]) > 0 and rows["int8"][2] != "0, 0, 0"  # timed, and a different model
    assert "2 photos of" in run.stdout and "1 interleaved repeats, one thread" in run.stdout
