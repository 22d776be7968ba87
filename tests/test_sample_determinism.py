"""The sample data is the same bytes whatever code path the CPU selects (issue: an AMD machine
generated other bytes than an Intel one, so the committed data/raw.dvc failed there).

Libraries pick SIMD kernels by CPU at run time: OpenCV (OPENCV_CPU_DISABLE), numpy
(NPY_DISABLE_CPU_FEATURES), OpenBLAS (OPENBLAS_CORETYPE), libjpeg-turbo (JSIMD_FORCENONE) and torch
(ATEN_CPU_CAPABILITY). Each can be switched down to its baseline here, so a run with every switch
down stands in for an older or a different CPU, and one pinned to a single core for a smaller
machine. Each run is a fresh interpreter (the switches are read at load time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


_GENERATE = """
import hashlib, json, sys, tempfile
from pathlib import Path
from facepipe.config import SampleDataParams
from facepipe.synthetic.photos import make_sample_dataset
with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "raw"
    make_sample_dataset(out, SampleDataParams(identities=4, images_per_identity=4, seed=0, bad_files=True))
    files = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.rglob("*")) if p.is_file()}
print(json.dumps(files))
"""


def _numpy_dispatched() -> str:
    """The dispatch targets numpy found on this CPU, space-separated (what NPY_DISABLE_CPU_FEATURES takes)."""
    code = (
        "from numpy._core._multiarray_umath import __cpu_features__ as f, __cpu_dispatch__ as d;"
        "print(' '.join(k for k in d if f.get(k)))"
    )
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _opencv_dispatched() -> str:
    """OpenCV's dispatch targets this CPU has, comma-separated as OPENCV_CPU_DISABLE takes them
    (``getCPUFeaturesLine``: ``*`` marks a dispatched feature, ``?`` one the CPU lacks)."""
    code = "import cv2; print(','.join(f[1:] for f in cv2.getCPUFeaturesLine().split() if f[0] == '*' and f[-1] != '?'))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _baseline_env() -> dict[str, str]:
    env = {"OPENCV_CPU_DISABLE": _opencv_dispatched(), "OPENBLAS_CORETYPE": "Prescott", "JSIMD_FORCENONE": "1"}
    env["ATEN_CPU_CAPABILITY"] = "default"
    dispatched = _numpy_dispatched()
    if dispatched:
        env["NPY_DISABLE_CPU_FEATURES"] = dispatched
    return env


def _run(code: str, extra_env: dict[str, str], *, one_core: bool = False) -> str:
    env = {**os.environ, **extra_env}
    preexec = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, preexec_fn=preexec, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.multiprocess
def test_the_switches_reach_opencv_on_this_machine():
    """The test below has teeth only if switching OpenCV's dispatch down changes what its optimised
    float kernels compute here; this shows that it does (on a CPU with nothing above the baseline the
    comparison below proves less, and this test says so by skipping)."""
    code = (
        "import cv2, numpy as np, hashlib;"
        "x = np.random.default_rng(0).uniform(0, 255, (480, 640, 3)).astype(np.float32);"
        "y = cv2.GaussianBlur(x, (0, 0), 1.7); z = cv2.resize(x, (517, 389), interpolation=cv2.INTER_CUBIC);"
        "print(hashlib.sha256(y.tobytes() + z.tobytes()).hexdigest())"
    )
    dispatched = _opencv_dispatched()
    if not dispatched:
        pytest.skip("OpenCV dispatches nothing above its baseline on this CPU")
    # the switch reaches OpenCV: every feature it names is off ("?") and nothing unknown is warned of
    line = subprocess.run(
        [sys.executable, "-c", "import cv2; print(cv2.getCPUFeaturesLine())"], env={**os.environ,
        "OPENCV_CPU_DISABLE": dispatched}, check=True, capture_output=True, text=True,
    )
    assert all(f"*{feature}?" in line.stdout.split() for feature in dispatched.split(",")), line.stdout
    assert "unknown" not in line.stderr, line.stderr
    default, down = _run(code, {}), _run(code, {"OPENCV_CPU_DISABLE": dispatched})
    if default == down:
        pytest.skip("OpenCV's optimised float kernels agree with its baseline ones on this CPU")


@pytest.mark.multiprocess
def test_sample_data_bytes_do_not_depend_on_cpu_dispatch_or_core_count():
    """4 identities x 4 images (every special kind and every bad kind): the same file bytes with
    every library at its best kernels, with every library at its baseline, and on one core."""
    default = json.loads(_run(_GENERATE, {}))
    assert len(default) == 4 * 4 + 7
    baseline = json.loads(_run(_GENERATE, _baseline_env()))
    one_core = json.loads(_run(_GENERATE, {}, one_core=True))
    differ = sorted(name for name in default if baseline.get(name) != default[name])
    assert not differ, f"{len(differ)} files differ at baseline dispatch: {differ[:5]}"
    assert one_core == default


def test_cpu_independent_turns_opencv_dispatch_off_and_restores_it():
    import cv2

    from facepipe.synthetic.photos import cpu_independent

    before = cv2.useOptimized()
    with cpu_independent():
        assert cv2.useOptimized() is False
    assert cv2.useOptimized() is before
    with pytest.raises(RuntimeError), cpu_independent():
        raise RuntimeError
    assert cv2.useOptimized() is before


def test_luma_is_the_601_weighted_sum_in_a_fixed_order():
    import numpy as np

    from facepipe.synthetic.photos import _luma

    rgb = np.random.default_rng(0).uniform(0, 255, (7, 5, 3)).astype(np.float32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    got = _luma(rgb)
    assert got.dtype == np.float32 and got.shape == (7, 5)
    assert np.array_equal(got, (r * np.float32(0.299) + g * np.float32(0.587)) + b * np.float32(0.114))
    assert _luma(rgb.astype(np.float64)).dtype == np.float64
    assert _luma(np.array([255.0, 255.0, 255.0])) == pytest.approx(255.0, abs=1e-12)
