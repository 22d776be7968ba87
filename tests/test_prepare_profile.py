"""``benchmarks/prepare_profile.py --timers``: the phase table of a worker's CPU time, per photo."""

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
