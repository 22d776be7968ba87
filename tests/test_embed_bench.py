"""What benchmarks/embed_bench.py computes from its runs: memory over the whole process tree, ratios
against the same set's loop, rates per worker process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from embed_bench import LOOP, Row, Run, measure, summary  # noqa: E402 - a script, not a package

MIB = 2**20

# a child that forks a grandchild; the grandchild touches 200 MiB and both wait a little
TREE = """
import os, time
if os.fork() == 0:
    block = bytearray(200 * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(1.0)
    os._exit(0)
os.wait()
print("done")
"""


def test_peak_memory_counts_the_grandchildren_and_cpu_their_time() -> None:
    wall, cpu, rss, pss, stdout = measure([sys.executable, "-c", TREE])
    assert stdout.strip() == "done"
    assert rss >= 200 * MIB and pss >= 190 * MIB  # the grandchild's pages, seen from the top process
    assert 1.0 <= wall < 30 and cpu > 0


def run(faces: int, process: float, photos: int = 10) -> Run:
    return Run(wall=2 * process, cpu=process, rss=MIB, pss=MIB, process=process, startup=0.5, photos=photos, faces=faces)


def test_rows_are_compared_with_their_own_sets_loop_per_worker_process() -> None:
    rows = {
        f"a: {LOOP}": Row(1, [run(10, 10.0), run(10, 5.0), run(10, 20.0)]),  # median 1 face/s
        "a: two workers": Row(2, [run(40, 10.0), run(40, 10.0), run(40, 1.0)]),  # median 4 faces/s, 2 per core
        f"b: {LOOP}": Row(1, [run(30, 10.0)]),
        "b: one worker": Row(1, [run(30, 5.0)]),
    }
    table = {entry["run"]: entry for entry in summary(rows)}
    assert table["a: two workers"]["faces_per_s"] == 4.0 and table["a: two workers"]["faces_per_s_per_core"] == 2.0
    assert table["a: two workers"]["vs_loop_per_core"] == 2.0
    assert table["a: two workers"]["vs_loop_whole"] == pytest.approx((10 / 20) / (10 / 20))
    assert table["b: one worker"]["vs_loop_per_core"] == 2.0 and table[f"b: {LOOP}"]["vs_loop_per_core"] == 1.0
    assert table["b: one worker"]["cpu_ms_per_face"] == pytest.approx(1000 * 5.0 / 30)
